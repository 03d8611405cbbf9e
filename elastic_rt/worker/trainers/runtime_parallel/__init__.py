"""The runtime-parallel family: pipeline and tensor parallelism the runtime builds from one
:class:`~elastic_rt.worker.trainers.runtime_parallel.description.ModelDescription`."""

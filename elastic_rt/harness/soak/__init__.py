"""The soak: one elastic job trains while hundreds of seeded random faults land on it.

Where the chaos matrix (:mod:`elastic_rt.harness.chaos`) gives each fault a fresh
job, the soak gives one job all of them, so what a fault leaves behind (threads,
descriptors, memory, process groups, etcd keys, files) adds up and shows.
``scripts/bench/soak.py`` is its command line; ``tests/integration/test_soak.py``
runs a short one. The modules, one concern each:

- :mod:`.config`: the fault kinds, how many, how often, how big the job is;
- :mod:`.plan`: which node a fault may hit now (never below the job's minimum, never
  the last copy of the state);
- :mod:`.fleet`: the job's nodes as they come and go (new node ids), and the
  newest round and state holders read from the event log;
- :mod:`.faults`: each fault kind, injected into the running job;
- :mod:`.audit`: pure verdicts over the event log: faults survived and as designed,
  stalls, evictions no fault explains;
- :mod:`.footprint`: each worker's footprint curve over its re-forms;
- :mod:`.leftovers`: what the run left in etcd and in the temp dir;
- :mod:`.run`: the soak end to end, beside the chaos matrix's reference run;
- :mod:`.report`: the printed tables.
"""

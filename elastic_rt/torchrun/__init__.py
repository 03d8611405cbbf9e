"""``--rdzv-backend etcd-v3`` for stock torchrun, registered through the
``torchrun.handlers`` entry point (see :mod:`elastic_rt.torchrun.plugin`).

Stock torchrun restarts its whole worker group on every membership change; choose
``elastic-rt launch`` for in-process recovery (docs/torchrun.md). This package only
lets teams that keep torchrun share the project's etcd (TLS, users, clusters).

No module here imports ``torch.distributed.elastic`` at import time except those the
plugin's creator imports lazily, so torch's registry can load the entry point while it
is itself being imported.
"""

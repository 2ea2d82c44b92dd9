"""Deployment tooling: certificates, process harness, and latency tools.

* :mod:`fedddl.deploy.certs` - CA + server certificate, SuperNode auth keys;
* :mod:`fedddl.deploy.processes` - start/stop SuperLink and SuperNodes (free
  ports, readiness, whole-process-tree cleanup), ``flwr`` CLI helpers;
* :mod:`fedddl.deploy.warm_clientapp` - fork server that makes ClientApp starts cheap.

The helpers that import and patch Flower live in the Flower layer:
:mod:`fedddl.flower.grid` (``FastPollGrid``, ServerApp-side 50 ms reply polling) and
:mod:`fedddl.flower.fast_supernode` (SuperNode launcher with a short message poll).

Only the light modules are re-exported here (no flwr/torch import on ``import fedddl.deploy``).
"""

from fedddl.deploy.certs import (
    SuperNodeKeyPaths,
    TlsPaths,
    write_supernode_keys,
    write_tls_material,
)
from fedddl.deploy.processes import (
    DeploymentError,
    ManagedProcess,
    ProcessRegistry,
    flower_env,
    start_superlink,
    start_supernode,
)

__all__ = [
    "DeploymentError",
    "ManagedProcess",
    "ProcessRegistry",
    "SuperNodeKeyPaths",
    "TlsPaths",
    "flower_env",
    "start_superlink",
    "start_supernode",
    "write_supernode_keys",
    "write_tls_material",
]

"""fedddl's Flower layer shared by both sides: the only ``fedddl`` package that imports flwr.

* :mod:`fedddl.flower.protocol`: the localized-replica protocol in Flower messages (every
  record and key), imported by ``strategies/`` and ``clients/`` alike;
* :mod:`fedddl.flower.records`: raw bytes and tensors in Flower records;
* :mod:`fedddl.flower.grid`: Grid wrappers (byte counting, fast reply polling);
* :mod:`fedddl.flower.simulation`: the in-process simulation runner (an entry point);
* :mod:`fedddl.flower.fast_supernode`, :mod:`fedddl.deploy.warm_clientapp`: deployment
  helpers that patch Flower's polling and ClientApp start-up;
* :mod:`fedddl.flower.logs`: the core's log records in Flower's log.

Heavy imports stay in the submodules.
"""

"""Flower server side of fedddl: strategies (one per module) and the ServerApp.

* :class:`strategies.terngrad.TernGrad`: localized replicas, ternary gradients up and down.
* :class:`strategies.gradient_average.GradientAverage`: the same protocol, fp32 (baseline).
* stock :class:`flwr.serverapp.strategy.FedAvg` through ``strategy = "fedavg"``.

Heavy imports stay in the submodules.
"""

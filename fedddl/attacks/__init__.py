"""Attack injection for evaluating the server's defences (never part of an honest run).

* :mod:`fedddl.attacks.spec`: which attack (``KIND[:ARG]``) and which partitions attack
  (deterministic from the seed); imports nothing heavy.
* :mod:`fedddl.attacks.tamper`: how an attacker turns its honest reply into a malicious,
  well-formed one (Flower-free, on :class:`~fedddl.sync.messages.ClientReply`);
  :mod:`fedddl.attacks.adaptive`: the adaptive attacker's payload (``adaptive:F``);
  :mod:`fedddl.attacks.recode`: the encoder both re-encode forged values with.

The malicious ClientApp handler is :mod:`clients.malicious`.
"""

from fedddl.attacks.spec import ATTACK_KINDS, Attack, attacker_partitions, parse_attack

__all__ = ["ATTACK_KINDS", "Attack", "attacker_partitions", "parse_attack"]

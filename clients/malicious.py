"""A malicious ClientApp handler for evaluating the server's defences.

:func:`handle_malicious_train` wraps the honest handler of the localized-replica protocol
(:func:`clients.localized.compute_reply`): it computes the honest reply, then turns it into
the attacker's with :func:`fedddl.attacks.tamper.tamper_reply`. Every message it sends is
well-formed. Which partitions attack is :func:`fedddl.attacks.attacker_partitions` of the
run's seed; :func:`is_attacker` asks it for this node.
"""

from __future__ import annotations

from flwr.app import Context, Message

from clients.localized import compute_reply
from clients.shard import partition_of
from fedddl.app_config import AppConfig
from fedddl.attacks import Attack, attacker_partitions, parse_attack
from fedddl.flower.protocol import build_reply_content
from fedddl.sync.messages import ClientReply

__all__ = ["handle_malicious_train", "is_attacker"]


def run_attack(cfg: AppConfig) -> Attack | None:
    """The run's attack, or None."""
    return parse_attack(cfg.attack) if cfg.num_attackers > 0 else None


def is_attacker(context: Context, cfg: AppConfig) -> bool:
    """Whether this node's partition is one of the run's attackers."""
    if run_attack(cfg) is None:
        return False
    pid, num = partition_of(context.node_config)
    return pid in attacker_partitions(num, cfg.num_attackers, cfg.seed)


def handle_malicious_train(message: Message, context: Context, cfg: AppConfig) -> Message:
    """Answer a training message as the run's attacker (see the module docstring)."""
    from fedddl.attacks.tamper import tamper_reply

    attack = run_attack(cfg)
    assert attack is not None
    if attack.kind == "resync-spam":  # no need to compute what is never sent
        reply = ClientReply.resync_request(int(context.node_id), -1)
    else:
        reply = tamper_reply(compute_reply(message, context, cfg), attack)
    return Message(content=build_reply_content(reply), reply_to=message)

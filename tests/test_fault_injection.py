"""Fault injection in simulation (in-process ``InlineGrid``, no Ray).

A seeded wrapper around the ClientApp makes 20 % of the clients fail each round in
one of several ways; training must still converge, every fault must be caught for
the right reason without reaching the aggregate, and after a final catch-up every
replica must equal the server's shadow replica.
"""

from __future__ import annotations

import random
from collections.abc import Iterable

import pytest
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp

from clients.client_app import make_client_app
from clients.state import load_state, save_state
from fedddl.app_config import AppConfig
from fedddl.flower.inline_grid import InlineGrid
from fedddl.flower.protocol import parse_reply
from fedddl.flower.records import bytes_to_array
from strategies.registry import build_strategy
from strategies.terngrad import TernGrad

NODES = 10
ROUNDS = 50
KINDS = ("exception", "corrupt", "stale-lie", "stale-old", "wipe", "diverged", "missing")
# Part of the drop reason each kind must produce ("missing" never reaches the server).
REASONS = {
    "exception": "injected crash",
    "corrupt": "payload rejected",
    "stale-lie": "fingerprint mismatch",
    "stale-old": "is at version",
    "wipe": "resync from version -1",
    "diverged": "fingerprint mismatch",
}


def _round_of(message: Message) -> int:
    return int(message.content.config_records["config"]["server-round"])  # type: ignore[arg-type]


class FaultyClients:
    """Wrap a ClientApp; ``plan[(round, node)]`` names the fault of that delivery.

    Faults: ``exception`` (the app raises), ``corrupt`` (payload bytes damaged),
    ``stale-lie`` (the client silently skips this round's updates and claims the
    requested version), ``stale-old`` (skips them and reports its real, old version),
    ``wipe`` (``context.state`` lost, as a restarted SuperNode), ``diverged`` (a weight
    of the stored replica changed, as memory corruption), ``missing`` (the reply is
    lost: the client did the work, the server never hears back; a timeout looks the same).
    A fault on the replica (``wipe``, ``diverged``, ``stale-*``) is moot when the message
    brings a snapshot (it replaces the replica) or the client has no replica yet:
    :attr:`effective` records the faults that really happened.
    """

    def __init__(self, app: ClientApp, cfg: AppConfig, plan: dict[tuple[int, int], str]) -> None:
        self.app, self.cfg, self.plan = app, cfg, plan
        self.lost: set[str] = set()
        self.enabled = True
        self.effective: dict[tuple[int, int], str] = {}

    def _replica_version(self, context: Context) -> int:
        st = load_state(
            context.state,
            self.cfg.model_factory(),
            self.cfg.learning_rate,
            self.cfg.momentum,
        )
        return -1 if st.replica is None else st.replica.version

    def __call__(self, message: Message, context: Context) -> Message:
        key = (_round_of(message), context.node_id)
        kind = self.plan.get(key) if self.enabled else None
        replica_fault = kind in ("wipe", "diverged", "stale-lie", "stale-old")
        if replica_fault and (
            "snapshot" in message.content.array_records
            or "updates" not in message.content.array_records
            or self._replica_version(context) < 0
        ):
            kind = None
        if kind is not None:
            self.effective[key] = kind
        if kind == "exception":
            raise RuntimeError("injected crash")
        if kind == "wipe":
            context.state = RecordDict()
        if kind == "diverged":
            st = load_state(
                context.state,
                self.cfg.model_factory(),
                self.cfg.learning_rate,
                self.cfg.momentum,
            )
            assert st.replica is not None
            with_grad = next(iter(st.replica.model.parameters()))
            with_grad.data[0].add_(1e-3)
            st.saved_version = None  # changed outside the journal: store a new snapshot
            save_state(context.state, st)
        if kind in ("stale-lie", "stale-old"):
            return self._stale(message, context, lie=kind == "stale-lie")
        reply = self.app(message, context)
        if kind == "corrupt":
            update = reply.content.array_records["update"]
            raw = bytearray(bytes(update["payload"].data))
            raw[len(raw) // 2] ^= 0x5A
            update["payload"] = bytes_to_array(bytes(raw))
        if kind == "missing":
            self.lost.add(message.metadata.message_id)
        return reply

    def _stale(self, message: Message, context: Context, *, lie: bool) -> Message:
        """Compute on the replica as it is, without this message's updates."""
        config = message.content.config_records["config"]
        requested = int(config["model-version"])  # type: ignore[arg-type]
        own = self._replica_version(context)
        content = RecordDict({"config": ConfigRecord(dict(config))})
        content.config_records["config"]["model-version"] = own
        original = message.content  # shared with other nodes: swap, never mutate
        message.content = content
        try:
            reply = self.app(message, context)
        finally:
            message.content = original
        if lie:
            reply.content.metric_records["metrics"]["model-version"] = requested
        return reply


class LossyGrid(InlineGrid):
    """An :class:`InlineGrid` that loses the replies the wrapper marked as missing."""

    def __init__(self, clients: FaultyClients, num_nodes: int) -> None:
        super().__init__(clients, num_nodes)  # type: ignore[arg-type]
        self.clients = clients

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        replies = super().send_and_receive(messages, timeout=timeout)
        return [r for r in replies if r.metadata.reply_to_message_id not in self.clients.lost]


def _fault_plan(seed: int) -> dict[tuple[int, int], str]:
    """20 % of the nodes fail in each round from 2 on (round 1 gives everyone a replica;
    ``stale`` and ``diverged`` need one), each in a random way; seeded."""
    rng = random.Random(seed)
    plan = {}
    for rnd in range(2, ROUNDS + 1):
        for node in rng.sample(range(1000, 1000 + NODES), NODES // 5):
            plan[(rnd, node)] = rng.choice(KINDS)
    return plan


def test_twenty_percent_faulty_clients_per_round_still_converge_and_agree() -> None:
    # Every faulty node must be back in the next round, however often it failed: no
    # resync rate limit here (tests/test_untrusted_clients.py covers the limit); no
    # direction check either, which may drop an honest reply whose signs oppose the
    # others' late in a run (tests/test_direction_check.py, test_untrusted_near_bound.py).
    cfg = AppConfig(
        num_server_rounds=ROUNDS,
        min_available_nodes=NODES,
        seed=0,
        resync_interval=0,
        direction_check=0.0,
    )
    plan = _fault_plan(seed=7)
    clients = FaultyClients(make_client_app(cfg), cfg, plan)
    grid = LossyGrid(clients, NODES)
    strategy = build_strategy(cfg, cfg.model_factory())
    assert isinstance(strategy, TernGrad)
    strategy.start(grid=grid, initial_arrays=ArrayRecord(), num_rounds=ROUNDS)

    effective = clients.effective
    assert set(effective.values()) == set(KINDS)  # every kind really happened
    assert len(effective) >= 0.9 * len(plan), (len(effective), len(plan))
    assert [r.version for r in strategy.server.reports] == list(range(1, ROUNDS + 1))
    for report in strategy.server.reports:
        faulty = {n: k for (rnd, n), k in effective.items() if rnd == report.server_round}
        healthy = sorted(set(range(1000, 1000 + NODES)) - set(faulty))
        # Exactly the healthy nodes are aggregated (faulty ones of the previous round
        # are caught up and back), every fault is dropped for its own reason.
        assert report.accepted == healthy, (report.server_round, report.dropped)
        assert set(report.dropped) == {n for n, k in faulty.items() if k != "missing"}
        for node, why in report.dropped.items():
            assert REASONS[faulty[node]] in why, (faulty[node], why)

    from fedddl.data import as_tensors, load_dataset
    from fedddl.training import evaluate

    x, y = as_tensors(load_dataset("digits", split="test"))
    _, accuracy = evaluate(strategy.server.shadow.model, x, y)
    # Measured: 0.9244 with this plan (93 of 98 planned faults effective), 0.9311
    # without faults, 0.9289 / 0.9311 with fault plan seeds 1 / 2.
    assert accuracy > 0.85, accuracy

    # Final catch-up: one more configure_train (no faults), delivered to everyone.
    clients.enabled = False
    messages = list(strategy.configure_train(ROUNDS + 1, ArrayRecord(), ConfigRecord(), grid))
    assert len(messages) == NODES
    replies = list(grid.send_and_receive(messages))
    assert len(replies) == NODES
    target = strategy.server.shadow.fingerprint()
    for reply in replies:
        parsed = parse_reply(reply)
        assert not parsed.resync and parsed.model_version == strategy.server.shadow.version
        assert parsed.fingerprint == target[:32]
    for node, ctx in grid.contexts.items():
        st = load_state(
            ctx.state, cfg.model_factory(), cfg.learning_rate, cfg.momentum
        )
        assert st.replica is not None, node
        assert st.replica.version == strategy.server.shadow.version
        assert st.replica.fingerprint() == target, node


def test_round_with_fewer_valid_replies_than_min_replies_applies_nothing(
    flwr_warnings: list[str],
) -> None:
    cfg = AppConfig(num_server_rounds=3, min_available_nodes=4)
    plan = {(2, 1000): "exception", (2, 1001): "corrupt"}
    grid = LossyGrid(FaultyClients(make_client_app(cfg), cfg, plan), 4)
    strategy = build_strategy(cfg, cfg.model_factory())
    assert isinstance(strategy, TernGrad)
    strategy.server.min_replies = 3
    strategy.start(grid=grid, initial_arrays=ArrayRecord(), num_rounds=3)
    r1, r2, r3 = strategy.server.reports
    assert [r.version for r in (r1, r2, r3)] == [1, 1, 2]
    assert [r.skipped for r in (r1, r2, r3)] == [False, True, False]
    assert r2.accepted == [1002, 1003] and set(r2.dropped) == {1000, 1001}
    assert any("round 2 skipped: 2 valid replies, need 3" in line for line in flwr_warnings)
    assert [v for v, _ in strategy.server.log.since(0)] == [1, 2]
    # The round after the skipped one starts from version 1 for everyone: all four
    # replies (the two faulty nodes caught up by log) match the shadow at version 1.
    assert r3.accepted == [1000, 1001, 1002, 1003] and r3.replicas_equal
    for ctx in grid.contexts.values():
        st = load_state(
            ctx.state, cfg.model_factory(), cfg.learning_rate, cfg.momentum
        )
        assert st.replica is not None and st.replica.version == 1
        assert st.replica.fingerprint() == strategy.server.fingerprints[1]
    with pytest.raises(ValueError, match="min-replies"):
        AppConfig(min_replies=0)


def test_run_server_applies_min_replies_from_the_config() -> None:
    from strategies.server_app import run_server

    cfg = AppConfig(num_server_rounds=2, min_available_nodes=2, min_replies=3)
    result = run_server(InlineGrid(make_client_app(cfg), 2), cfg, progress=lambda line: None)
    assert [r["skipped"] for r in result["rounds"]] == [True, True]
    assert [r["model_version"] for r in result["rounds"]] == [0, 0]
    assert result["final_version"] == 0 and result["summary"]["skipped_rounds"] == 2
    assert result["final_accuracy"] == result["initial"]["accuracy"]


def test_a_duplicated_reply_is_counted_once() -> None:
    class DuplicatingGrid(InlineGrid):
        def send_and_receive(
            self, messages: Iterable[Message], *, timeout: float | None = None
        ) -> Iterable[Message]:
            replies = list(super().send_and_receive(messages, timeout=timeout))
            return [*replies, replies[0]] if replies else []  # e.g. a retransmission

    cfg = AppConfig(num_server_rounds=2, min_available_nodes=3)
    grid = DuplicatingGrid(make_client_app(cfg), 3)
    strategy = build_strategy(cfg, cfg.model_factory())
    assert isinstance(strategy, TernGrad)
    strategy.start(grid=grid, initial_arrays=ArrayRecord(), num_rounds=2)
    for report in strategy.server.reports:
        assert report.accepted == [1000, 1001, 1002]
        assert "already replied" in report.dropped[1000]
    assert strategy.server.reports[-1].replicas_equal

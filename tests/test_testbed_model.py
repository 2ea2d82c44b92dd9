"""Pure parts of the testbed: link rates, predictions, curves, wire bands, CLI parsing."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import ClassVar

import pytest

from fedddl.commands.testbed import parse_run_config
from fedddl.network import NetworkModel
from fedddl.testbed.compare import client_rates, flower_links
from fedddl.testbed.flower_run import (
    ACK_OVERHEAD,
    RETRANSMITTED_SEGMENT_BYTES,
    TCP_OVERHEAD,
    FlowerTestbed,
    time_to_target,
    wire_bounds,
)
from fedddl.testbed.gossip_run import gossip_rates, mean_accuracy_curve, shaper_spec
from fedddl.testbed.netns import LinkRates
from fedddl.testbed.predict import (
    WIRE_FACTOR,
    predict_flower,
    ratio,
    star_network,
    transfer_floor,
)


def _result(walls: list[float], accs: list[float], up: int, down: int) -> dict[str, object]:
    return {"rounds": [{"round": i + 1, "wall_s": w, "accuracy": a, "bytes_up": up,
                        "bytes_down": down if i else 0}
                       for i, (w, a) in enumerate(zip(walls, accs, strict=True))]}


def test_link_rates_reject_nonsense() -> None:
    with pytest.raises(ValueError, match="link rate"):
        LinkRates(uplink_Bps=0.0)
    with pytest.raises(ValueError, match="link rate"):
        LinkRates(per_peer_Bps={1: float("nan")})


def test_gossip_rates_follow_the_matrix_and_shaper_adds_its_latency() -> None:
    net = NetworkModel([[0, 0.01, 0.2], [0.01, 0, 0.2], [0.2, 0.2, 0]],
                       [[0, 1e8, 2e6], [1e8, 0, 2e6], [1e6, 1e6, 0]])
    rates = gossip_rates(net)
    assert rates[0].per_peer_Bps == {1: 1e8, 2: 2e6}
    assert rates[0].uplink_Bps == 1e8 and rates[0].downlink_Bps == 1e8
    assert rates[2].uplink_Bps == 1e6 and rates[2].downlink_Bps == 2e6
    assert shaper_spec(net, 2) == "0=0.2,1=0.2"


def test_client_rates_of_a_homogeneous_profile_are_its_bandwidth() -> None:
    rates = client_rates(NetworkModel.homogeneous(3, 0.0, 1.25e6))
    assert all(r.uplink_Bps == r.downlink_Bps == 1.25e6 for r in rates)


def test_predict_flower_adds_per_client_transfers_to_the_reference_compute() -> None:
    reference = _result([5.0, 2.0, 4.0, 3.0], [0.1, 0.5, 0.7, 0.9], 100, 100)
    run = _result([9.0, 9.0, 9.0, 9.0], [0.1, 0.5, 0.7, 0.9], 2_000_000, 1_000_000)
    clients = [LinkRates(uplink_Bps=1e6, downlink_Bps=5e5)] * 2
    p = predict_flower(run, reference, clients, fab_bytes=500_000, target=0.7, wire_factor=1.0)
    # Round 1: reference round 1 (5 s) + 1 MB up per client at 1 MB/s + FAB 0.5 MB at 0.5 MB/s.
    assert p["round_s"][0] == pytest.approx(5.0 + 1.0 + 1.0)
    # Later: median of the reference's later rounds (3 s) + 1 s up + 0.5 MB down at 0.5 MB/s.
    assert p["round_s"][1:] == pytest.approx([5.0, 5.0, 5.0])
    assert p["time_to_target_s"] == pytest.approx(7.0 + 5.0 + 5.0)
    assert p["fab_s"] == pytest.approx(1.0)
    assert p["transfer_s"] == pytest.approx(2.0 + 3 * 2.0)


def test_a_transfer_floor_takes_the_reference_transfers_out_of_later_rounds() -> None:
    reference = _result([5.0, 2.0, 4.0, 3.0], [0.1, 0.5, 0.7, 0.9], 100, 100)
    run = _result([9.0, 9.0, 9.0, 9.0], [0.1, 0.5, 0.7, 0.9], 2_000_000, 1_000_000)
    clients = [LinkRates(uplink_Bps=1e6, downlink_Bps=5e5)] * 2
    # 1 s up and 1 s down a round beyond round 1: the floor hides all of the upload
    # (1.5 s >= 1 s) and a quarter of the download.
    p = predict_flower(run, reference, clients, fab_bytes=500_000, target=0.7, wire_factor=1.0,
                       transfer_floor_s={"up": 1.5, "down": 0.25})
    assert p["round_s"][0] == pytest.approx(5.0 + 1.0 + 1.0)  # round 1: whole transfers
    assert p["round_s"][1:] == pytest.approx([3.0 + 0.75] * 3)
    assert p["transfer_s"] == pytest.approx(2.0 + 3 * 0.75)
    assert p["transfer_floor_s"] == {"up": 1.5, "down": 0.25}
    assert predict_flower(run, reference, clients, wire_factor=1.0)["transfer_floor_s"] is None


def test_transfer_floor_is_the_median_span_after_round_one() -> None:
    # One SuperNode and the server; 0.5 s samples. Reference rounds of 2 s at t = 0, 2, 4, 6:
    # the node downloads for 0.5, 1.0, 1.5 s from each round's start and uploads 0.5 s.
    rows, sent, got = [], 0.0, 0.0
    down = {0: 1, 2: 2, 4: 3, 6: 2}  # intervals of 0.5 s from the round's start
    for i in range(17):
        t = i * 0.5
        rows.append([1000.0 + t, t, sent, got, got, sent])
        start = int(t // 2 * 2)
        into = t - start
        if into < 0.5 * down[min(start, 6)]:
            got += 1e6 * 0.5
        elif into == 1.5:
            sent += 1e6 * 0.5
    reference = {"rounds": [{"round": k + 1, "started_at": 1000.0 + 2 * k, "wall_s": 2.0}
                            for k in range(4)]}
    floor = transfer_floor(reference, rows, clients=1)
    assert floor == pytest.approx({"down": 1.0, "up": 0.5})  # median of 1.0, 1.5, 1.0
    with pytest.raises(ValueError, match="after the first"):
        transfer_floor({"rounds": reference["rounds"][:1]}, rows, clients=1)


def test_predict_flower_charges_tcp_framing_by_default() -> None:
    """The shaped link carries 1514-byte frames per 1448 payload bytes, so every transfer
    takes WIRE_FACTOR x bytes / rate (the compute term is unchanged)."""
    reference = _result([5.0, 3.0], [0.1, 0.5], 100, 100)
    run = _result([9.0, 9.0], [0.1, 0.5], 2_000_000, 1_000_000)
    clients = [LinkRates(uplink_Bps=1e6, downlink_Bps=5e5)] * 2
    p = predict_flower(run, reference, clients, fab_bytes=500_000)
    assert pytest.approx(1514 / 1448) == WIRE_FACTOR
    assert p["wire_factor"] == WIRE_FACTOR
    assert p["round_s"] == pytest.approx([5.0 + 2.0 * WIRE_FACTOR, 3.0 + 2.0 * WIRE_FACTOR])
    assert p["fab_s"] == pytest.approx(WIRE_FACTOR)
    assert p["transfer_s"] == pytest.approx(4.0 * WIRE_FACTOR)


def test_star_network_leaves_unlimited_directions_fast() -> None:
    net = star_network([LinkRates(uplink_Bps=1e6), LinkRates()], latency_s=0.01)
    assert net.transfer_time(0, 2, 1_000_000) == pytest.approx(1.01)
    assert net.transfer_time(2, 0, 1_000_000) < 0.011
    assert net.transfer_time(1, 2, 1_000_000) < 0.011


def test_time_to_target_sums_round_times_until_the_first_crossing() -> None:
    run = _result([2.0, 3.0, 4.0], [0.3, 0.8, 0.6], 1, 1)
    assert time_to_target(run, 0.7) == 5.0
    assert time_to_target(run, 0.9) is None
    assert ratio(10.0, 8.0) == 1.25 and ratio(None, 8.0) is None and ratio(1.0, 0.0) is None


def test_rounds_without_evaluation_count_only_their_time() -> None:
    # eval-every 2: rounds 1 and 3 have no accuracy (None), as the recorder writes them
    run = _result([2.0, 3.0, 4.0, 1.0], [None, 0.5, None, 0.8], 1, 1)  # type: ignore[list-item]
    assert time_to_target(run, 0.7) == 10.0
    assert time_to_target(run, 0.4) == 5.0
    reference = _result([1.0, 1.0, 1.0, 1.0], [None, 0.5, None, 0.8], 1, 1)  # type: ignore[list-item]
    p = predict_flower(run, reference, [LinkRates()] * 2, target=0.7)
    assert p["time_to_target_s"] == pytest.approx(p["total_s"])


def test_mean_accuracy_curve_aligns_nodes_on_wall_clock() -> None:
    metrics = [
        {"started_at": 100.0,
         "accuracy": [{"t": 0.0, "accuracy": 0.1}, {"t": 2.0, "accuracy": 0.9}]},
        {"started_at": 101.0,
         "accuracy": [{"t": 0.0, "accuracy": 0.3}, {"t": 2.0, "accuracy": 0.5}]},
    ]
    curve = mean_accuracy_curve(metrics)
    assert curve == [[0.0, pytest.approx(0.2)], [1.0, pytest.approx(0.2)],
                     [2.0, pytest.approx(0.6)], [3.0, pytest.approx(0.7)]]


def test_wire_bounds_are_payload_plus_framing_up_to_idle_traffic() -> None:
    section = {"app_bytes": {"up": 1_000_000, "down": 500_000, "fab_per_supernode": 250_000},
               "supernodes": 2, "idle_rate_Bps": {"tx": 1000.0, "rx": 100.0}, "run_s": 10.0}
    bounds = wire_bounds(section, slack=0.0)
    low, high = bounds["tx_bytes"]
    assert low == pytest.approx(1e6 * (1 + TCP_OVERHEAD) + 1e6 * ACK_OVERHEAD)
    assert high == pytest.approx(low + 10_000)
    low, high = bounds["rx_bytes"]
    assert low == pytest.approx(1e6 * (1 + TCP_OVERHEAD) + 1e6 * ACK_OVERHEAD)
    assert high == pytest.approx(low + 1000)
    assert math.isclose(TCP_OVERHEAD, 66 / 1448)


def test_wire_bounds_count_what_each_direction_s_sender_retransmitted() -> None:
    section = {"app_bytes": {"up": 1_000_000, "down": 500_000, "fab_per_supernode": 250_000},
               "supernodes": 2, "idle_rate_Bps": {"tx": 1000.0, "rx": 100.0}, "run_s": 10.0}
    plain = wire_bounds(section, slack=0.0)
    section["retransmitted_segments"] = {"supernodes": 10, "superlink": 3}
    resent = wire_bounds(section, slack=0.0)
    assert resent["tx_bytes"][0] == plain["tx_bytes"][0]
    assert resent["tx_bytes"][1] == pytest.approx(plain["tx_bytes"][1] + 10 * 1514)
    assert resent["rx_bytes"][0] == plain["rx_bytes"][0]
    assert resent["rx_bytes"][1] == pytest.approx(plain["rx_bytes"][1] + 3 * 1514)
    assert RETRANSMITTED_SEGMENT_BYTES == 1514


def test_parse_run_config_reads_flower_syntax_and_refuses_garbage() -> None:
    assert parse_run_config("dataset='fashion-mnist' num-server-rounds=30 lr=0.05 x=true") == {
        "dataset": "fashion-mnist", "num-server-rounds": 30, "lr": 0.05, "x": True}
    with pytest.raises(ValueError, match="quoted string"):
        parse_run_config("dataset=digits")
    with pytest.raises(ValueError, match="cannot parse"):
        parse_run_config("dataset 'digits'")


def test_flower_testbed_works_in_an_absolute_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Flower's config file refuses relative certificate paths: a relative --out must work.
    monkeypatch.chdir(tmp_path)
    bed = FlowerTestbed([LinkRates()], "out", tmp_path)
    assert bed.work == tmp_path / "out"
    assert bed.work.is_absolute()


def test_a_failed_testbed_run_is_run_once_more_then_raised(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from fedddl.deploy.processes import DeploymentError
    from fedddl.testbed.compare import run_once_more_on_failure
    from fedddl.testbed.flower_run import RunTimeout

    calls: list[int] = []

    def flaky() -> dict[str, int]:
        calls.append(1)
        if len(calls) == 1:
            raise DeploymentError("flwr run x failed (exit 0):\nlog")
        return {"ok": 1}

    assert run_once_more_on_failure(flaky, "x") == {"ok": 1} and len(calls) == 2
    assert "x failed (flwr run x failed (exit 0):); running it once more" in capsys.readouterr().err

    def broken() -> dict[str, int]:
        calls.append(1)
        raise DeploymentError("no")

    calls.clear()
    with pytest.raises(DeploymentError, match="no"):
        run_once_more_on_failure(broken, "y")
    assert len(calls) == 2

    def too_long() -> dict[str, int]:
        calls.append(1)
        raise RunTimeout("flwr run z exceeded 1800.0 s")

    calls.clear()
    with pytest.raises(RunTimeout, match="exceeded"):  # past its bound: not run again
        run_once_more_on_failure(too_long, "z")
    assert len(calls) == 1


def test_predict_flower_charges_a_shared_server_link_all_clients_bytes() -> None:
    """A shaped SuperLink link carries every client's bytes: a direction takes the longer of
    the slowest client's own link and the server link with the round's total."""
    reference = _result([5.0, 3.0, 3.0], [0.1, 0.5, 0.6], 100, 100)
    run = _result([9.0, 9.0, 9.0], [0.1, 0.5, 0.6], 4_000_000, 2_000_000)
    clients = [LinkRates(uplink_Bps=1e6, downlink_Bps=1e6)] * 4
    alone = predict_flower(run, reference, clients, fab_bytes=250_000, wire_factor=1.0)
    # Own links only: 1 MB up, 0.5 MB down per client at 1 MB/s; FAB 0.25 MB.
    assert alone["round_s"] == pytest.approx([5.0 + 1.0 + 0.25, 3.0 + 1.5, 3.0 + 1.5])
    server = LinkRates(uplink_Bps=1e6, downlink_Bps=2e6)
    shared = predict_flower(run, reference, clients, fab_bytes=250_000, wire_factor=1.0,
                            server=server)
    # Up: 4 MB over the 2 MB/s server downlink (2 s > 1 s); down: 2 MB over its 1 MB/s
    # uplink (2 s); round 1's FAB: 4 x 0.25 MB over the uplink (1 s).
    assert shared["round_s"] == pytest.approx([5.0 + 2.0 + 1.0, 3.0 + 2.0 + 2.0, 3.0 + 4.0])
    assert shared["fab_s"] == pytest.approx(1.0)
    # A server link faster than the clients' together changes nothing.
    fast = predict_flower(run, reference, clients, fab_bytes=250_000, wire_factor=1.0,
                          server=LinkRates(uplink_Bps=1e7, downlink_Bps=1e7))
    assert fast["round_s"] == pytest.approx(alone["round_s"])


def test_flower_links_take_the_superlink_from_a_profile_with_one_node_more() -> None:
    clients, server = flower_links(NetworkModel.homogeneous(4, 0.0, 1.25e6), 4)
    assert len(clients) == 4 and server == LinkRates()
    clients, server = flower_links(NetworkModel.homogeneous(5, 0.0, 1.25e7), 4)
    assert len(clients) == 4 and all(r.uplink_Bps == 1.25e7 for r in clients)
    assert server.uplink_Bps == server.downlink_Bps == 1.25e7
    with pytest.raises(ValueError, match=r"takes 4 .* or 5"):
        flower_links(NetworkModel.homogeneous(3, 0.0, 1.25e6), 4)


def test_flower_profiles_load_with_supernodes_or_one_more(tmp_path: Path) -> None:
    from fedddl.commands.testbed import _flower_network
    from fedddl.network import NetworkError, load_network

    path = tmp_path / "five.toml"
    path.write_text('profile = "homogeneous"\nnum_nodes = 5\nlatency_s = 0.0\n'
                    "bandwidth_Bps = 1250000.0\n")
    assert _flower_network(str(path), 4, load_network).num_nodes == 5
    with pytest.raises(NetworkError, match="5 nodes"):
        _flower_network(str(path), 3, load_network)
    for rate in ("10", "100"):
        net = _flower_network(f"simulations/networks/clients4-{rate}mbit.toml", 4, load_network)
        assert net.num_nodes == 4 and net.bandwidth_Bps[0, 1] == int(rate) * 125_000
    for rate in ("10", "100"):
        shared = _flower_network(f"simulations/networks/clients4-server{rate}mbit.toml", 4,
                                 load_network)
        clients, server = flower_links(shared, 4)
        assert len(clients) == 4
        assert server.uplink_Bps == server.downlink_Bps == int(rate) * 125_000
        assert clients[0].uplink_Bps == int(rate) * 125_000


def test_superlink_link_takes_no_per_peer_rates(tmp_path: Path) -> None:
    bed = FlowerTestbed([LinkRates()] * 2, tmp_path, tmp_path)
    with pytest.raises(ValueError, match="no per-peer rates"):
        bed.set_server_rates(LinkRates(per_peer_Bps={0: 1e6}))


class _FakeBed:
    """Stands in for FlowerTestbed in flower_matrix: records each run's config and links."""

    runs: ClassVar[list[tuple[str, dict[str, object], object]]] = []

    def __init__(self, *_args: object, **_kwargs: object) -> None:
        self.server: object = None

    def __enter__(self) -> _FakeBed:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def set_client_rates(self, rates: object) -> None:
        pass

    def set_server_rates(self, rates: object) -> None:
        self.server = rates

    def run(self, config: dict[str, object], name: str, *, target: float,
            timeout_s: float) -> dict[str, object]:
        assert timeout_s == 1800.0  # flower_matrix's default bound, passed on
        _FakeBed.runs.append((name, dict(config), self.server))
        rounds = int(config["num-server-rounds"])  # type: ignore[call-overload]
        result = _result([2.0] * rounds, [0.5] * rounds, 1_000_000, 1_000_000)
        result.update(final_accuracy=0.5, testbed={
            "name": name,
            "app_bytes": {"up": rounds * 1_000_000, "down": rounds * 1_000_000,
                          "fab_per_supernode": 1000},
            "wire": {"tx_bytes": 1, "rx_bytes": 1}, "load_avg_before": [1.0, 1.0, 1.0]})
        return result


def test_flower_matrix_runs_references_with_their_own_rounds_and_shapes_the_server(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from fedddl.testbed import compare

    monkeypatch.setattr(compare, "FlowerTestbed", _FakeBed)
    _FakeBed.runs = []
    rows = compare.flower_matrix(
        supernodes=2, networks=[("shared", NetworkModel.homogeneous(3, 0.0, 1.25e6))],
        strategies=["terngrad"], run_config={"num-server-rounds": 10}, target=0.9, repeats=1,
        out_dir=tmp_path, app_dir=tmp_path, reference_rounds=3)
    (ref_name, ref_config, ref_server), (name, config, server) = _FakeBed.runs
    assert ref_name.startswith("unlimited") and ref_config["num-server-rounds"] == 3
    assert ref_server == LinkRates()
    assert name.startswith("shared") and config["num-server-rounds"] == 10
    assert server == LinkRates(uplink_Bps=1.25e6, downlink_Bps=1.25e6)
    # 1 MB up and down per round over the shared 1.25 MB/s server link, 2 s of compute.
    assert rows[1]["predicted_median_round_s"] == pytest.approx(2.0 + 2 * WIRE_FACTOR / 1.25)
    assert rows[1]["median_round_s"] == 2.0
    with pytest.raises(ValueError, match="reference_rounds"):
        compare.flower_matrix(
            supernodes=2, networks=[], strategies=["terngrad"], run_config={}, target=0.9,
            repeats=1, out_dir=tmp_path, app_dir=tmp_path, reference_rounds=1)
    with pytest.raises(ValueError, match="run_timeout_s"):
        compare.flower_matrix(
            supernodes=2, networks=[], strategies=["terngrad"], run_config={}, target=0.9,
            repeats=1, out_dir=tmp_path, app_dir=tmp_path, run_timeout_s=0)


class _SampledBed(_FakeBed):
    """A fake whose unlimited runs leave activity samples: each client uploads for the
    first 0.4 s of every 2 s round (and nothing is downloaded)."""

    out: ClassVar[Path]

    def run(self, config: dict[str, object], name: str, *, target: float,
            timeout_s: float) -> dict[str, object]:
        result = super().run(config, name, target=target, timeout_s=timeout_s)
        rounds = result["rounds"]
        assert isinstance(rounds, list)
        for k, record in enumerate(rounds):
            record["started_at"] = 1000.0 + 2.0 * k
        rows, sent = [], 0.0
        for i in range(20 * len(rounds) + 1):
            t = 0.1 * i
            rows.append([1000.0 + t, t, sent, 0.0, sent, 0.0, 0.0, 0.0])
            if round(t % 2.0, 6) < 0.4:
                sent += 1e5
        if name.startswith("unlimited"):
            results = self.out / "deployment" / "results"
            results.mkdir(parents=True, exist_ok=True)
            (results / f"{name}.activity.json").write_text(json.dumps({"samples": rows}))
        return result


def test_flower_matrix_takes_the_references_transfer_time_out_of_the_prediction(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from fedddl.testbed import compare

    monkeypatch.setattr(compare, "FlowerTestbed", _SampledBed)
    _SampledBed.runs, _SampledBed.out = [], tmp_path
    rows = compare.flower_matrix(
        supernodes=2, networks=[("shared", NetworkModel.homogeneous(3, 0.0, 1.25e6))],
        strategies=["terngrad"], run_config={"num-server-rounds": 10}, target=0.9, repeats=1,
        out_dir=tmp_path, app_dir=tmp_path, reference_rounds=3)
    transfer = WIRE_FACTOR / 1.25  # 1 MB each way over the shared 1.25 MB/s link
    assert rows[1]["transfer_floor_s"] == "0.4/0.0"
    assert rows[1]["predicted_median_round_s"] == pytest.approx(2.0 + 2 * transfer - 0.4)
    assert rows[1]["ratio_additive"] == pytest.approx(2.0 / (2.0 + 2 * transfer))
    saved = json.loads((tmp_path / "shared-terngrad-rep0.json").read_text())["prediction"]
    assert saved["transfer_floor_s"] == pytest.approx({"up": 0.4, "down": 0.0})


def test_running_finds_a_program_in_a_process_command_line() -> None:
    import os

    from fedddl.testbed.netns import running

    assert running([os.getpid()], "python") or running([os.getpid()], "pytest")
    assert not running([os.getpid()], "flwr-serverapp-that-is-not-here")
    assert not running([2**22 + 12345], "python")  # no such process


def test_gossip_variants_give_the_compressed_variant_its_compressor() -> None:
    from fedddl.commands.testbed import gossip_variants

    assert gossip_variants("scheduled,scheduled+compressed,random", "ternary-entropy") == [
        ("scheduled", "scheduled", True, {}),
        ("scheduled+compressed", "scheduled", True, {"compressor": "ternary-entropy"}),
        ("random", "random", False, {}),
    ]
    with pytest.raises(ValueError, match="unknown gossip variants"):
        gossip_variants("scheduled,compressed", "ternary-base3")


def _gossip_result(config: dict[str, object]) -> dict[str, object]:
    node = {"node_id": 0, "bytes_sent": 1000, "sent": 10, "mean_transfer_s": {"1": 0.01},
            "sent_to": {"1": 10}, "steps_per_s": 10.0, "steps": 20}
    return {"config": {"nodes": 2, "target_accuracy": 0.5, **config}, "nodes": [node],
            "duration_s": 2.0, "final_accuracy": 0.6, "time_to_target_s": 1.0,
            "steps_per_s": [10.0, 10.0], "messages": 10, "bytes_total": 1000,
            "testbed": {"wire_tx_bytes": 1100, "load_avg_after": [1.0, 1.0, 1.0]}}


@pytest.fixture
def simulated_configs(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, object]]:
    """The configurations ``predict_gossip`` hands the gossip simulator (which is not run)."""
    import fedddl.gossip

    seen: list[dict[str, object]] = []

    def fake_run_gossip(config: dict[str, object]) -> dict[str, object]:
        seen.append(config)
        return {}

    monkeypatch.setattr(fedddl.gossip, "run_gossip", fake_run_gossip)
    return seen


def test_predict_gossip_simulates_the_peers_compressor_and_eval_subset(
        simulated_configs: list[dict[str, object]]) -> None:
    from fedddl.testbed.predict import predict_gossip

    seen = simulated_configs
    predict_gossip(_gossip_result({"scheduler": "scheduled", "overlap": True,
                                   "compressor": "ternary-base3", "consensus-step": 0.5,
                                   "eval-samples": 300}), "homogeneous")
    predict_gossip(_gossip_result({"scheduler": "random", "overlap": False}), "homogeneous")
    compressed, plain = seen
    assert compressed["compressor"] == "ternary-base3"
    assert compressed["consensus_step"] == 0.5 and compressed["scale_bucket"] == 0
    assert compressed["eval_samples"] == 300
    assert "compressor" not in plain and plain["eval_samples"] == 0
    # the peers' curve gains a point every eval-every x step time / nodes (here 10 x 0.1 / 2)
    assert compressed["eval_interval_s"] == pytest.approx(0.5)
    assert compressed["stop_at_target"] is False


def test_predict_gossip_evaluates_at_least_every_quarter_second_and_can_stop_at_target(
        simulated_configs: list[dict[str, object]]) -> None:
    from fedddl.testbed.predict import predict_gossip

    seen = simulated_configs
    fast = {"scheduler": "scheduled", "overlap": True, "eval-every": 1}
    sim = predict_gossip(_gossip_result(fast), "homogeneous", stop_at_target=True)
    assert seen[0]["eval_interval_s"] == 0.25 and seen[0]["stop_at_target"] is True
    assert sim["eval_interval_s"] == 0.25 and sim["stop_at_target"] is True
    predict_gossip(_gossip_result(fast), "homogeneous", eval_interval_s=2.0)
    assert seen[1]["eval_interval_s"] == 2.0


def test_gossip_matrix_resumes_saved_variants_and_predicts_unpredicted_ones(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import json

    from fedddl.testbed import compare

    runs: list[dict[str, object]] = []
    predictions: list[str] = []

    def fake_run(network: NetworkModel, work: Path, *, scheduler: str, overlap: bool,
                 target: float, peer_options: dict[str, object]) -> dict[str, object]:
        runs.append(dict(peer_options))
        return _gossip_result({"scheduler": scheduler, "overlap": overlap, **peer_options})

    def fake_predict(result: dict[str, object], network: str, **kw: object) -> dict[str, object]:
        predictions.append(network)
        return {"time_to_target_s": 2.0, "curve": [], "messages": 5, "bytes_total": 500,
                "final_accuracy": 0.6, "compute_time_s": 0.1, "stale_merges": 0,
                "message_overhead_s": kw["message_overhead_s"],
                "downlink_holds_latency": kw["downlink_holds_latency"],
                "eval_interval_s": 0.25, "stop_at_target": kw["stop_at_target"]}

    monkeypatch.setattr(compare, "run_gossip_testbed", fake_run)
    monkeypatch.setattr(compare, "predict_gossip", fake_predict)
    variants = [("scheduled", "scheduled", True, {}),
                ("scheduled+compressed", "scheduled", True, {"compressor": "ternary-base3"})]
    kwargs = {"network_spec": "homogeneous", "nodes": 2, "peer_options": {"steps": 20},
              "target": 0.5, "repeats": 1, "out_dir": tmp_path}
    rows = compare.gossip_matrix(variants=variants, predict=False, **kwargs)  # type: ignore[arg-type]
    assert [r["predicted_time_to_target_s"] for r in rows] == [None, None]
    assert runs[1]["compressor"] == "ternary-base3" and "compressor" not in runs[0]
    saved = json.loads((tmp_path / "scheduled+compressed-rep0.json").read_text())
    assert saved["config"]["compressor"] == "ternary-base3"
    rows = compare.gossip_matrix(variants=variants, resume=True, **kwargs)  # type: ignore[arg-type]
    assert len(runs) == 2  # nothing ran again
    assert len(predictions) == 4  # published and corrected, for each unpredicted variant
    assert [r["ratio"] for r in rows] == [0.5, 0.5]
    assert "prediction_corrected" in json.loads((tmp_path / "scheduled-rep0.json").read_text())
    compare.gossip_matrix(variants=variants, resume=True, **kwargs)  # type: ignore[arg-type]
    assert len(runs) == 2 and len(predictions) == 4  # saved predictions are reused


def test_eval_subset_is_fixed_by_its_seed_and_zero_keeps_everything() -> None:
    import torch

    from fedddl.gossip.eval_subset import eval_subset

    x, y = torch.arange(100.0).reshape(50, 2), torch.arange(50)
    assert eval_subset(x, y, 0, 1)[1].tolist() == y.tolist()
    assert eval_subset(x, y, 60, 1)[1].tolist() == y.tolist()
    a, b = eval_subset(x, y, 10, 3)[1], eval_subset(x, y, 10, 3)[1]
    assert a.tolist() == b.tolist() == sorted(a.tolist()) and len(set(a.tolist())) == 10
    assert eval_subset(x, y, 10, 4)[1].tolist() != a.tolist()
    with pytest.raises(ValueError, match="eval samples"):
        eval_subset(x, y, -1, 0)

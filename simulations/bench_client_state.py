"""What a client writes to ``context.state`` per round: snapshot every round vs snapshot + journal.

For a ResNet-18 replica (CIFAR-10 shapes, 11.2 M parameters, momentum buffers), applies
``--rounds`` ternary broadcast updates and saves the client state after each, two ways in
the same run:

* ``snapshot``: the whole replica (weights, buffers, momentum) every round, as before the
  journal (forced by marking the state as changed outside the journal);
* ``journal``: the default, one encoded update per round and a full snapshot every
  ``clients.state.JOURNAL_LIMIT`` updates.

It prints, per way, the mean bytes of the records written per round (Flower's serialized
size of the changed records) and the mean seconds of ``save_state``, then their ratio.
A state loaded in a fresh process (cache miss) is checked to rebuild the replica bit for
bit in both ways.

    python -m simulations.bench_client_state --rounds 16
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=16, help="updates applied (default: 16)")
    parser.add_argument("--arch", default="resnet18", help="model (default: resnet18)")
    args = parser.parse_args(argv)

    import torch
    from flwr.app import RecordDict

    from clients.state import load_state, save_state
    from fedddl.compression import get_compressor
    from fedddl.compression.codecs.downlink import (
        decode_broadcast_parts,
        encode_bundle,
        encode_reencoded,
    )
    from fedddl.flower.records import content_nbytes
    from fedddl.models import create_model
    from fedddl.replica import Replica
    from fedddl.running_stats import batchnorm_layers
    from fedddl.sync.worker import WorkerState

    torch.set_num_threads(1)
    build = lambda: create_model("cifar10", seed=0, arch=args.arch)  # noqa: E731
    gen = torch.Generator().manual_seed(0)
    template = build()
    stats = {}
    for name, layer in batchnorm_layers(template).items():
        c = layer.num_features
        stats |= {f"{name}.mean": torch.zeros(c), f"{name}.var": torch.ones(c),
                  f"{name}.count": torch.tensor([512.0])}
    updates = []
    for version in range(1, args.rounds + 1):
        grads = {n: torch.randn(p.shape, generator=gen) * 1e-3
                 for n, p in template.named_parameters()}
        compressor = get_compressor("ternary-base3", seed=version)
        updates.append(encode_bundle(encode_reencoded(grads, compressor, None), statistics=stats))
    print(f"{args.arch}: {sum(p.numel() for p in template.parameters()):,} parameters, "
          f"encoded update {len(updates[0]):,} B", flush=True)

    results = {}
    for way in ("snapshot", "journal"):
        state = RecordDict()
        worker = WorkerState(Replica(build(), 0.1, 0.9), "ternary-base3")
        written, seconds = [], []
        for version, payload in enumerate(updates, start=1):
            assert worker.replica is not None
            update, statistics_ = decode_broadcast_parts(payload)
            worker.replica.apply_update(update, version, statistics_)
            worker.journal.append((version, payload))
            if way == "snapshot":
                worker.saved_version = None  # the old behaviour: the whole replica every round
            snapshot_before = state.array_records.get("fedddl.replica")
            meta_before = state.config_records.get("fedddl.meta")
            version_before = meta_before["version"] if meta_before is not None else 0
            start = time.perf_counter()
            save_state(state, worker)
            seconds.append(time.perf_counter() - start)
            snapshot = state.array_records["fedddl.replica"]
            full = 0 if snapshot is snapshot_before else content_nbytes(RecordDict({"r": snapshot}))
            meta = state.config_records["fedddl.meta"]
            journal, saved = meta["journal"], meta["saved-version"]
            assert isinstance(journal, list) and isinstance(saved, int)
            assert isinstance(version_before, int)
            entries = sum(  # the journaled updates this round added
                len(p) for i, p in enumerate(journal)
                if isinstance(p, bytes) and saved + 1 + i > version_before
            )
            written.append(full + entries)
        back = load_state(state, build, 0.1, 0.9)
        assert back.replica is not None and worker.replica is not None
        same = back.replica.fingerprint() == worker.replica.fingerprint()
        results[way] = (statistics.mean(written), statistics.mean(seconds))
        print(f"{way:8s}: {results[way][0] / 1e6:8.2f} MB written a round, save_state "
              f"{results[way][1] * 1e3:7.1f} ms a round; reloaded replica bit-identical: {same}",
              flush=True)
    ratio = results["snapshot"][0] / results["journal"][0]
    print(f"state bytes a round: snapshot {results['snapshot'][0] / 1e6:.2f} MB, journal "
          f"{results['journal'][0] / 1e6:.2f} MB ({ratio:.1f}x fewer)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

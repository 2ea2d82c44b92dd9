"""``fedddl deploy certs OUT_DIR``: TLS certificates, SuperNode keys, gossip peer certificates."""

from __future__ import annotations

import argparse

NAME = "deploy"
HELP = "deployment helpers: generate TLS certificates and SuperNode authentication keys"

__all__ = ["HELP", "NAME", "add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``certs`` and its options."""
    sub = parser.add_subparsers(dest="deploy_command", metavar="ACTION", required=True)
    certs = sub.add_parser(
        "certs",
        help="write ca.crt, server.pem/.key and SuperNode key pairs",
        formatter_class=parser.formatter_class,
    )
    certs.add_argument("out_dir", help="directory to write into (created if missing)")
    certs.add_argument("--host", action="append", dest="hosts", metavar="NAME_OR_IP",
                       help="SuperLink host name or IP for the certificate, in addition "
                            "to 127.0.0.1 and localhost (which the SuperLink's own SuperExec "
                            "uses); repeatable (default: only those two)")
    certs.add_argument("--supernodes", type=int, default=0, metavar="N",
                       help="also write N SuperNode key pairs supernode-0 ... supernode-N-1")
    certs.add_argument("--gossip-peers", type=int, default=0, metavar="N",
                       help="also issue N gossip peer certificates (node ids 0 ... N-1) from "
                            "the same CA into OUT_DIR/gossip, for the peers' --tls-dir "
                            "(default: 0, none)")
    certs.add_argument("--valid-days", type=int, default=365,
                       help="validity of the certificates, in days")


def run(args: argparse.Namespace) -> int:
    """Generate the files and print the flags that use them."""
    from pathlib import Path

    from fedddl.deploy.certs import DEFAULT_HOSTS, write_supernode_keys, write_tls_material

    if args.supernodes < 0 or args.gossip_peers < 0:
        print("--supernodes and --gossip-peers must be >= 0")
        return 2
    out = Path(args.out_dir)
    # dict.fromkeys: de-duplicate, keep order (the first name is the subject CN).
    hosts = list(dict.fromkeys([*(args.hosts or []), *DEFAULT_HOSTS]))
    tls = write_tls_material(
        out, hosts, valid_days=args.valid_days, gossip_peers=args.gossip_peers
    )
    names = [f"supernode-{i}" for i in range(args.supernodes)]
    keys = write_supernode_keys(out / "supernode-keys", names) if names else []
    print(f"wrote {tls.ca_certificate}, {tls.server_certificate}, {tls.server_private_key}")
    print("SuperLink:  flower-superlink " + " ".join(tls.superlink_args())
          + (" --enable-supernode-auth" if keys else ""))
    for pair in keys:
        print(f"{pair.name}: flwr supernode register {pair.public_key} <connection>")
        print(f"    flower-supernode --root-certificates {tls.ca_certificate} "
              f"--auth-supernode-private-key {pair.private_key} ...")
    if tls.gossip_dir is not None:
        print(f"gossip peers 0..{args.gossip_peers - 1}: {tls.gossip_dir}/node-<id>.pem/.key; "
              f"copy ca.crt and its own pair to each machine, then "
              f"python -m fedddl.gossip.peer --tls-dir DIR ...")
    return 0

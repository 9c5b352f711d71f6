"""`diloco certs`: set a deployment up in one command: a CA, certificates for every service and client, and
fresh join/admin tokens (see `diloco.rpc.tls` for the layout)."""

from __future__ import annotations

import argparse
from pathlib import Path

from diloco.errors import ConfigError
from diloco.rpc.tls import DEFAULT_HOSTS, write_bundle


def _csv(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "certs",
        help="write a CA, certificates and tokens for mutual TLS",
        description=(
            "Write into DIR: ca.pem/ca.key; coordinator.pem/.key and healthd.pem/.key (server and client "
            "certificates, SANs from --hosts); admin.pem/.key (for `diloco ctl`); one client certificate per "
            "worker; join.token and admin.token. Keys and tokens are mode 0600. Every process then takes "
            "--tls-dir DIR (env DILOCO_TLS_DIR) and --tls-name NAME (its <NAME>.pem/<NAME>.key)."
        ),
    )
    p.add_argument("--out", type=Path, required=True, metavar="DIR", help="folder to write (created if missing)")
    who = p.add_mutually_exclusive_group()
    who.add_argument("--workers", type=int, default=0, help="N: certificates worker0..worker(N-1)")
    who.add_argument("--names", default="", help="worker certificate names, comma-separated")
    p.add_argument(
        "--hosts",
        default=",".join(DEFAULT_HOSTS),
        help="DNS names and IPs the services are reached by (server certificate SANs), comma-separated",
    )
    p.add_argument("--no-tokens", action="store_true", help="do not write join.token and admin.token")
    p.add_argument(
        "--etcd",
        action="store_true",
        help="also etcd.pem/etcd.key: etcd's server certificate (SANs from --hosts), for coordinator leadership over "
        "https (docs/ha.md)",
    )
    p.add_argument("--force", action="store_true", help="overwrite an existing CA in DIR")
    p.set_defaults(func=run)


def run(a: argparse.Namespace) -> int:
    if a.workers < 0:
        raise ConfigError(f"--workers must be >= 0, got {a.workers}")
    clients = [f"worker{i}" for i in range(a.workers)] if a.workers else (_csv(a.names) or ["worker"])
    hosts = _csv(a.hosts)
    if not hosts:
        raise ConfigError("--hosts: give at least one DNS name or IP")
    if (a.out / "ca.pem").exists() and not a.force:
        raise ConfigError(f"{a.out} already holds a CA (ca.pem); pass --force to replace every certificate")
    written = write_bundle(a.out, clients=clients, hosts=hosts, tokens=not a.no_tokens, etcd=a.etcd)
    print(f"wrote {len(written)} files to {a.out}: " + ", ".join(p.name for p in written))
    print(f"services: --tls-dir {a.out} (coordinator, healthd); workers: --tls-name <name>; ctl: --tls-name admin")
    if a.etcd:
        d = a.out
        print(
            f"etcd: --cert-file {d}/etcd.pem --key-file {d}/etcd.key --trusted-ca-file {d}/ca.pem --client-cert-auth; "
            f"coordinators: --etcd https://HOST:2379 --etcd-ca-file {d}/ca.pem --etcd-cert-file {d}/coordinator.pem "
            f"--etcd-key-file {d}/coordinator.key"
        )
    return 0

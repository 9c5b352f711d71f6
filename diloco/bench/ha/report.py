"""The HA section's Markdown, from its results alone."""

from __future__ import annotations

import math
import statistics
from typing import Any

from diloco.bench.ha.settings import REPLICAS
from diloco.bench.ha.summary import invariant_list, median, min_ratio, ms, num
from diloco.bench.section import table


def markdown(r: dict[str, Any]) -> str:
    s = r["settings"]["soak"]
    soak, m = r["soak"], r["summary"]
    parts = [
        "Command: `python -m diloco.bench.bench_ha` (`diloco/bench/bench_ha.py`; its docstring says what each step "
        "waits for). Real processes on loopback, plaintext: etcd (Debian's etcd-server), two coordinator replicas "
        f"under its leadership (`--etcd`, `--replication-log {s['replication_log']} --sync-replicas 1`, lease TTL "
        f"2 s), healthd and {s['workers']} learners of the tiny task (`diloco.cluster.TINY_TASK_ARGS`), all given both "
        f"addresses, decoupled rounds (K = {s['min_quorum']}, H = {s['local_steps']}, learners slowed "
        f"{s['slowdown']:g}x), a checkpoint every {s['checkpoint_every']} rounds. The benchmark supervises the "
        f"replicas: one that ends is started again on its port {s['restart_delay_s']:g} s later, and comes back as "
        f"a standby. After a {s['steady_s']:g} s steady phase, {s['kills']} leader SIGKILLs (seed {s['seed']}), each "
        "once the standby holds the leader's newest version, at a drawn point: right after the leader's "
        f"`round.closed`, right after a learner's `worker.submitted` (mid-round), or after a delay in [0, "
        f"{s['max_delay_s']:g}] s; then one more kill hands the lead to a standby restarted with the job's target "
        f"set ahead (version {soak.get('final_target', '–')}), which ends the job. Times run from the SIGKILL to the "
        "new leader's own log timestamps. Load average when the section started: "
        f"{', '.join(f'{x:.1f}' for x in r['load_average'])} (1, 5, 15 min).",
    ]
    if r["error"]:
        parts.append(f"**The soak stopped before its end:** {r['error']}")
    if m:
        t = m["times"]

        def row(label: str, x: dict[str, Any]) -> list[str]:
            return [label, str(x["n"]), num(x["median"]), num(x["p90"]), num(x["max"])]

        rows = [
            row("kill → new leader elected (`leadership.changed`)", t["elected_s"]),
            row("kill → new leader serving (`replica.promoted`)", t["serving_s"]),
            row("kill → first round committed by the new leader", t["first_round_s"]),
            *(row(f"… kill {p}", x) for p, x in m["first_round_by_point"].items()),
            row("kill → the killed replica restarted and in step again (a standby)", t["standby_back_s"]),
        ]
        parts.append(table(["failover", "kills", "median (s)", "p90 (s)", "max (s)"], rows))
        lost, ratio = m["lost_steady_s_per_failover"], m["cycle_rate_ratio"]
        parts.append(
            f"Throughput: {num(m['steady_tokens_per_s'], 0)} tokens/s applied in the steady phase; "
            f"{num(m['soak_tokens_per_s'], 0)} tokens/s over the soak (first to last kill, a kill every "
            f"{num(m['cycle_s']['median'], 1)} s in the median). Per kill cycle (a kill to the next), the rate was "
            f"{num(ratio['median'])}x the steady one in the median (lowest {num(min_ratio(soak, m))}x): each failover "
            f"cost {num(lost['mean'], 1)} s of steady-state throughput on average (median {num(lost['median'], 1)} s, "
            f"max {num(lost['max'], 1)} s). That includes the killed replica's restart (a new Python process importing "
            "torch and building the task) competing with the learners for the 2 cores."
        )
        lag = m["lag_versions"]
        hist = ", ".join(f"{k} behind: {v}" for k, v in lag["histogram"].items())
        a2p = m["applied_to_published_s"]
        parts.append(
            f"Standby lag in the steady phase ({lag['samples']} samples every {s['lag_poll_s']:g} s of the lag the "
            "leader's GetStatus reports, as `diloco ctl status` shows it: the round log's newest version minus the "
            f"standby's newest acknowledged): {hist}; max {lag['max']}, mean {num(lag['mean'])} versions. With "
            "`--sync-replicas 1` the leader publishes a version only once the standby acknowledged it, so the standby "
            "is never behind a published version; the version it lags is the one the leader has stepped and is "
            "waiting on. Standby applied a version → the leader "
            f"published it: median {num(ms(a2p['median']), 1)} ms, p90 {num(ms(a2p['p90']), 1)} ms, max "
            f"{num(ms(a2p['max']), 1)} ms ({a2p['n']} versions)."
        )
        problems = invariant_list(soak)
        parts.append(
            f"After the soak: the job {'finished' if soak['finished'] else 'did NOT finish'} at version "
            f"{soak['version']} of {soak['target']} ({soak['tokens_applied']:,} tokens, {soak['wall_s']:.0f} s in "
            f"all); {soak['published_without_standby']} version(s) published with no standby following (while the "
            f"killed replica restarted: `replication.degraded`, nobody lagging) and {soak['ack_timeouts']} after a "
            "standby's ack timed out; "
            f"{m['stale_wins']} election(s) won by the killed replica's own restart; "
            f"{len(soak['unplanned_replica_exits'])} replica exit(s) nobody caused. Invariants (every learner's "
            "received versions non-decreasing; each new leader at or above every version received before its kill; "
            "no version committed twice, commits in order; epochs rising; ledger exactly once; job at its target; "
            "no learner exit before the end): "
            + ("all hold." if not problems else "**broken**: " + "; ".join(problems))
        )
    if r["cost"]:
        rows = []
        for c in r["cost"]:
            cs = c["settings"]
            for run in (c["plain"], c["replicated"]):
                repl = run["replicated"]
                rows.append(
                    [
                        cs["label"],
                        "2 replicas, `--sync-replicas 1`" if repl else "one coordinator",
                        f"{cs['workers']} × H = {cs['local_steps']}",
                        ", ".join(num(median(x["intervals_s"]), 3) for x in run["runs"]),
                        num(run["round_s"], 3),
                        "–" if not repl or c["ratio"] is None else f"{c['ratio'] - 1:+.1%}",
                        num(ms(run["close_s"]), 1),
                        "–" if not repl or c["close_extra_fraction"] is None else f"{c['close_extra_fraction']:+.1%}",
                        num(ms(median(run["applied_to_published_s"])), 1) if repl else "–",
                        f"{run['wall_s']:.0f}",
                    ]
                )
        parts.append(
            "Cost of synchronous replication: the same job in `sync` rounds (every learner H steps, the round "
            "closes on the last learner's submission, learners wait for the new version), with one plain "
            "coordinator and with two replicas under etcd and `--sync-replicas 1`, alternating in this run. Round: "
            "median interval between the leader's `round.closed` lines after the first rounds (per run, and pooled "
            "over the runs of a kind). Close: median time from the submission that closed a round to its "
            "publication (merge, outer step and, replicated, the log entry and the wait for the standby's ack); its "
            "increase over one coordinator, as a share of the plain round, is the replication's own latency on a "
            "round, and what the target is checked on: whole rounds are mostly the learners' compute, which on this "
            "shared 2-core machine varies between two runs of the same kind by more than the effect (compare the "
            "per-run medians). Ack wait: the standby applied a version → the leader published it. The standby here "
            "shares the cores with the learners and the leader; on its own machine its work (receiving, replaying "
            "and checking each version) would not slow them."
        )
        parts.append(
            table(
                [
                    "model",
                    "coordinator",
                    "learners",
                    "round, per run (s)",
                    "round, pooled (s)",
                    "vs one",
                    "close (ms)",
                    "close over one, / round",
                    "ack wait (ms)",
                    "wall s",
                ],
                rows,
            )
        )
        parts.append(cores_text(r["cost"]))
        parts += [
            f"**{c['settings']['label']}: a run failed:** {'; '.join(c['errors'])}" for c in r["cost"] if c["errors"]
        ]
    return "\n\n".join(parts)


def cores_text(costs: list[dict[str, Any]]) -> str:
    """What shared the machine with the learners while the rounds were timed, in cores (of 2)."""

    def learners(cores: dict[str, float]) -> str:
        xs = [v for n, v in cores.items() if n.startswith("worker")]
        return f"learners {statistics.fmean(xs):.2f} each" if xs else "learners –"

    out = []
    for c in costs:
        p, q = c["plain"]["cores"], c["replicated"]["cores"]
        if not p or not q:
            continue
        out.append(
            f"{c['settings']['label']}: one coordinator {p.get('coordinator', math.nan):.2f}, {learners(p)}; "
            f"replicated: leader {q.get(REPLICAS[0], math.nan):.2f}, standby {q.get(REPLICAS[1], math.nan):.2f}, "
            f"etcd {q.get('etcd', math.nan):.2f}, {learners(q)}"
        )
    return (
        "CPU while the rounds were timed, in cores of the 2 (mean over the runs; the rest of the machine's load is "
        "other jobs): " + "; ".join(out) + "."
        if out
        else ""
    )

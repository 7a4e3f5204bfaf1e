"""Explain a launch that did not finish: where each rank is, and what the mismatch looks like.

Pure functions over the per-rank snapshots the launcher collects, so they are tested directly.
The classic bugs: a collective inside ``if rank == 0`` (one rank skips it), different shapes on
different ranks, and two ranks that both ``recv`` first (a point-to-point deadlock).
"""

from __future__ import annotations

from collections import defaultdict

from helpers.launcher.errors import format_frames


def _ranks(rs) -> str:
    rs = sorted(rs)
    return ("rank " if len(rs) == 1 else "ranks ") + ", ".join(map(str, rs))


def describe_rank(rank: int, info: dict) -> str:
    """One rank's state: finished, blocked in a call, or running Python, with its stack."""
    snap = info.get("snapshot")
    if info.get("finished"):
        last = snap and snap.get("last")
        return f"rank {rank}: finished (returned from the function; last call: {last or 'none'})"
    if snap is None:
        text = f"rank {rank}: did not answer (it may hold the GIL in a long C call)"
        if info.get("dump"):
            text += "\n  its threads, dumped by faulthandler:\n" + _indent(info["dump"], 4)
        return text
    waited = snap["now"] - (snap["call_start"] or snap["since"])
    if snap["call"]:
        head = f"rank {rank}: blocked in {snap['call']} for {waited:.1f} s"
    elif snap["state"] == "running":
        last = f" (last call: {snap['last']})" if snap["last"] else ""
        head = f"rank {rank}: running Python code, in no torch.distributed call{last}"
    else:
        head = f"rank {rank}: {snap['state']}"
    stack = format_frames(snap["stack"]).rstrip()
    return head + ("\n" + _indent(stack, 2) if stack else "")


def _indent(text: str, n: int) -> str:
    return "\n".join(" " * n + line for line in text.splitlines())


def findings(infos: dict[int, dict]) -> list[str]:
    """What the states say together: the likely bug, in words a student can act on."""
    finished = [r for r, i in infos.items() if i.get("finished")]
    blocked = {
        r: i["snapshot"]
        for r, i in infos.items()
        if not i.get("finished") and (i.get("snapshot") or {}).get("call")
    }
    out = []
    collectives = {r: s for r, s in blocked.items() if s["call_key"][1] is not None}
    p2p = {r: s for r, s in blocked.items() if s["call_key"][1] is None}
    if finished and collectives:
        ops = sorted({s["call_key"][2] for s in collectives.values()})
        out.append(
            f"{_ranks(finished)} returned while {_ranks(collectives)} wait in {', '.join(ops)}: "
            "a rank skipped a collective the others called. Every rank must call every "
            "collective, in the same order (look for a collective inside `if rank == ...`)."
        )
    by_group = defaultdict(dict)
    for r, s in collectives.items():
        by_group[s["call_key"][0]][r] = s["call_key"]
    for r in finished:  # a finished rank's last collective may be the mismatched one
        last = (infos[r].get("snapshot") or {}).get("last_key")
        if last and last[1] is not None and last[0] in by_group:
            if any(k[1] == last[1] for k in by_group[last[0]].values()):
                by_group[last[0]][r] = last
    for group, keys in by_group.items():
        seqs = defaultdict(list)
        for r, key in keys.items():
            seqs[key[1]].append(r)
        if len(seqs) > 1:
            where = "; ".join(f"{_ranks(rs)} at #{q}" for q, rs in sorted(seqs.items()))
            out.append(
                f"The ranks are at different collectives on {group} ({where}): one rank made "
                "an extra call or skipped one."
            )
        for seq, rs in seqs.items():
            variants = defaultdict(list)
            for r in rs:
                variants[keys[r][2:]].append(r)
            if len(variants) < 2:
                continue
            ops = {op for op, _ in variants}
            parts = "; ".join(f"{_ranks(v)}: {op}({t})" for (op, t), v in variants.items())
            if len(ops) > 1:
                out.append(
                    f"The ranks disagree on collective #{seq} on {group}: {parts}. Every rank "
                    "must call the same collective at the same point."
                )
            else:
                out.append(
                    f"The ranks call {ops.pop()} #{seq} on {group} with different tensors: "
                    f"{parts}. Shapes and dtypes must match on every rank."
                )
    if p2p:
        receivers = {r for r, s in p2p.items() if s["call_key"][2] == "recv"}
        # A cycle: every receiver waits on a peer that is itself blocked receiving.
        if len(receivers) > 1 and all(p2p[r]["call_peer"] in receivers for r in receivers):
            pairs = ", ".join(f"{r}←{p2p[r]['call_peer']}" for r in sorted(receivers))
            out.append(
                f"Deadlock: every unfinished rank waits to receive ({pairs}) and none is "
                "sending. Let one side send first (e.g. even ranks send then receive, odd ranks "
                "receive then send), or use isend/irecv."
            )
        for r, s in p2p.items():
            peer = s["call_peer"]
            if peer in finished:
                out.append(
                    f"rank {r} waits in {s['call_key'][2]} with peer rank {peer}, which has "
                    "returned: the matching send/recv was never made."
                )
    return out


def explain(infos: dict[int, dict], timeout: float, world_size: int) -> str:
    """The whole timeout message: the verdict, then every rank's state and stack."""
    stuck = [r for r, i in infos.items() if not i.get("finished")]
    lines = [
        f"launch did not finish within {timeout:g} s: {_ranks(stuck)} of {world_size} still "
        "running. All ranks were stopped."
    ]
    lines += ["", *findings(infos)] if findings(infos) else []
    lines += ["", "Where each rank was:"]
    lines += [describe_rank(r, infos[r]) for r in sorted(infos)]
    return "\n".join(lines)

"""Which collective does each backend run, on CPU and on GPU tensors? Asked live, not copied.

Lecture 01 puts the slides' static backend × op table beside what this torch actually does:
``support_table()`` runs every op (and every reduction op of all_reduce) on 2 ranks for each
backend × device this machine can try, checks the result, and says ✓, ✗ (with the error), or
why it could not be tried (no GPU, backend not built). ``SLIDES`` is the slides' table.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

OPS = (
    "send",
    "recv",
    "broadcast",
    "all_reduce",
    "reduce",
    "all_gather",
    "gather",
    "scatter",
    "reduce_scatter",
    "all_to_all",
    "barrier",
)
REDUCE_OPS = ("SUM", "AVG", "PRODUCT", "MIN", "MAX")
COLUMNS = ("gloo CPU", "gloo GPU", "mpi CPU", "mpi GPU", "nccl CPU", "nccl GPU")

# The seeds' slides (002, "Multi-GPU Training", High Performance Deep Learning), copied as
# printed: the table of torch.distributed's documentation of their time. The slides are undated;
# Lightning's `strategy=` argument they use dates them to late 2021 (Lightning 1.5) or later.
_SLIDES = {  # gloo CPU, gloo GPU, mpi CPU, mpi GPU, nccl CPU, nccl GPU
    "send": "✓✗✓?✗✓",
    "recv": "✓✗✓?✗✓",
    "broadcast": "✓✓✓?✗✓",
    "all_reduce": "✓✓✓?✗✓",
    "reduce": "✓✗✓?✗✓",
    "all_gather": "✓✗✓?✗✓",
    "gather": "✓✗✓?✗✓",
    "scatter": "✓✗✓?✗✗",
    "reduce_scatter": "✗✗✗✗✗✓",
    "all_to_all": "✗✗✓?✗✓",
    "barrier": "✓✗✓?✗✓",
}
SLIDES = {op: dict(zip(COLUMNS, marks, strict=True)) for op, marks in _SLIDES.items()}


def _expect(op: str, r: int, n: int, reduce_op: str = "SUM") -> list | None:
    """What rank ``r`` of ``n`` must hold after ``op`` on the probe's inputs (None: undefined)."""
    own = [[10.0 * k + i for i in range(n)] for k in range(n)]  # rank k starts with 10k + i
    combine = {
        "SUM": sum,
        "AVG": lambda v: sum(v) / n,
        "PRODUCT": lambda v: __import__("math").prod(v),
        "MIN": min,
        "MAX": max,
    }[reduce_op]
    column = [combine([own[k][i] for k in range(n)]) for i in range(n)]
    return {
        "send": own[r],
        "recv": own[(r - 1) % n],
        "broadcast": own[0],
        "all_reduce": column,
        "reduce": column if r == 0 else None,
        "all_gather": [own[k][0] for k in range(n)],
        "gather": [own[k][0] for k in range(n)] if r == 0 else None,
        "scatter": [own[0][r]],
        "reduce_scatter": [column[r]],
        "all_to_all": [own[k][r] for k in range(n)],
        "barrier": own[r],
    }[op]


def _run(op: str, device, group=None, reduce_op: str = "SUM") -> list | None:
    """Do ``op`` once on this rank with tensors on ``device``; return what this rank holds."""
    r, n = dist.get_rank(group), dist.get_world_size(group)
    mine = torch.tensor([10.0 * r + i for i in range(n)], device=device)  # (n,)
    red = getattr(dist.ReduceOp, reduce_op)
    if op in ("send", "recv"):  # a ring: even ranks send first, so blocking calls cannot deadlock
        got = torch.zeros(n, device=device)
        right, left = (r + 1) % n, (r - 1) % n
        for turn in (0, 1):
            if (r % 2 == 0) == (turn == 0):
                dist.send(mine, right, group=group)
            else:
                dist.recv(got, left, group=group)
        return (mine if op == "send" else got).tolist()
    if op == "broadcast":
        dist.broadcast(mine, src=0, group=group)
    elif op == "all_reduce":
        dist.all_reduce(mine, op=red, group=group)
    elif op == "reduce":
        dist.reduce(mine, dst=0, op=red, group=group)
        return mine.tolist() if r == 0 else None
    elif op == "all_gather":
        got = [torch.zeros(1, device=device) for _ in range(n)]
        dist.all_gather(got, mine[:1], group=group)
        return torch.cat(got).tolist()
    elif op == "gather":
        got = [torch.zeros(1, device=device) for _ in range(n)] if r == 0 else None
        dist.gather(mine[:1], got, dst=0, group=group)
        return torch.cat(got).tolist() if r == 0 else None
    elif op == "scatter":
        got = torch.zeros(1, device=device)
        dist.scatter(got, list(mine.split(1)) if r == 0 else None, src=0, group=group)
        return got.tolist()
    elif op == "reduce_scatter":
        got = torch.zeros(1, device=device)
        dist.reduce_scatter(got, list(mine.split(1)), op=red, group=group)
        return got.tolist()
    elif op == "all_to_all":
        got = torch.zeros(n, device=device)
        dist.all_to_all_single(got, mine, group=group)
        return got.tolist()
    elif op == "barrier":
        dist.barrier(group=group)
    else:
        raise ValueError(f"unknown op {op!r}: choose from {', '.join(OPS)}")
    return mine.tolist()


def _probes(ops=OPS, reduce_ops=REDUCE_OPS) -> list[tuple[str, str]]:
    """(op, reduce_op) of every probe: each op with SUM, then all_reduce with the others."""
    return [(op, "SUM") for op in ops] + [("all_reduce", red) for red in reduce_ops[1:]]


def _alone(probe, backend: str, device_type: str, key: tuple[str, str]) -> dict:
    """One probe in a launch of its own: one that breaks its ranks is ✗, saying how."""
    from helpers.launcher.errors import LaunchError, LaunchTimeout, RankDied

    op, red = key
    reduce_ops = ("SUM",) if red == "SUM" else ("SUM", red)  # probe_rank's last row is this one
    try:
        return probe(probe_rank, backend, device_type, (op,), reduce_ops)[0][-1]
    except RankDied as exc:
        reason = "crashed the rank: " + _signal(exc)
    except LaunchTimeout:
        reason = "hung (no answer)"
    except LaunchError as exc:
        reason = "broke the group: " + _reason(exc)
    return {"op": op, "reduce_op": red, "ok": False, "reason": reason}


def _signal(exc) -> str:
    first = str(exc).splitlines()[0]
    return first[first.find("(") + 1 : first.find(")")] if "(" in first else first[:80]


def _reason(exc: BaseException) -> str:
    lines = [s.strip() for s in str(exc).splitlines() if s.strip()]
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"[:160]


def probe_rank(backend: str, device_type: str, ops=OPS, reduce_ops=REDUCE_OPS) -> list[dict]:
    """Run inside every rank: each op (and all_reduce with each reduction) on ``backend``.

    Returns one row per probe: {'op', 'reduce_op', 'ok', 'reason'}; ok is True when the op ran
    and every rank holds what it should (a rank that raised makes the probe False on all).
    """
    r, n = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", r % torch.cuda.device_count()) if device_type == "GPU" else "cpu"
    default = dist.get_backend()
    group = None if default == backend else dist.new_group(backend=backend)
    rows = []
    for op, red in _probes(ops, reduce_ops):
        try:
            held = _run(op, device, group, red)
            ok, reason = held == _expect(op, r, n, red), ""
            if not ok:
                reason = f"wrong result on rank {r}: {held}"
        except Exception as exc:  # an unsupported op raises before moving data, on every rank
            ok, reason = False, _reason(exc)
        rows.append({"op": op, "reduce_op": red, "ok": ok, "reason": reason})
    # All ranks must agree: one rank's failure (or wrong result) is the probe's failure.
    flags = torch.tensor([float(row["ok"]) for row in rows])
    dist.all_reduce(flags, op=dist.ReduceOp.MIN)  # on the default group: always works on CPU
    for row, flag in zip(rows, flags.tolist(), strict=True):
        row["ok"] = bool(flag)
    return rows


def why_not(backend: str, device_type: str, gpus: int | None = None) -> str:
    """'' if this machine can try ``backend`` on ``device_type`` with 2 ranks, else the reason."""
    if gpus is None:
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not getattr(dist, f"is_{backend}_available")():
        return f"{backend} not in this torch build"
    if backend == "nccl" and gpus < 2:  # NCCL cannot start at all without a GPU per rank
        return f"needs 2 GPUs ({gpus} here)"
    if device_type == "GPU" and gpus < 1:
        return "no GPU here"
    return ""


def support_table(world_size: int = 2, gpus: int | None = None, timeout: float = 120) -> list[dict]:
    """From the notebook: probe every backend × device column; one row per (op, reduce_op).

    Each row: {'op', 'reduce_op', <column>: '✓' | '✗' | '–', <column> + ' why': reason}.
    """
    from helpers.launcher.errors import LaunchError, LaunchTimeout
    from helpers.launcher.launch import launch

    cells: dict = {}
    for column in COLUMNS:
        backend, device_type = column.split()
        reason = why_not(backend, device_type, gpus)
        if reason:
            cells[column] = None, reason
            continue
        # the ranks join a gloo world (every machine has it) and open a group of `backend`
        base = "mpi" if backend == "mpi" else "gloo"
        probe = functools.partial(
            launch, world_size=world_size, backend=base, output="none", timeout=timeout
        )
        try:
            cells[column] = probe(probe_rank, backend, device_type)[0], ""
        except LaunchTimeout:  # an op that hangs instead of raising: the column is unknown
            cells[column] = None, f"probe hung (no answer in {timeout:g} s)"
        except LaunchError:
            # An op broke its process or the group instead of raising (gloo's send of a CUDA
            # tensor hands gloo a device address as host memory: on a one-GPU H200 node the
            # rank aborted, or the next collective failed "writev ...: Bad address"). Try the
            # ops one launch each, so that one breakage marks one op, not the column.
            cells[column] = [_alone(probe, backend, device_type, key) for key in _probes()], ""
    table = []
    for op, red in _probes():
        row = {"op": op, "reduce_op": red}
        for column, (rows, reason) in cells.items():
            if rows is None:
                row[column], row[column + " why"] = "–", reason
                continue
            hit = next(x for x in rows if x["op"] == op and x["reduce_op"] == red)
            row[column], row[column + " why"] = ("✓" if hit["ok"] else "✗"), hit["reason"]
        table.append(row)
    return table


def differences(table: list[dict]) -> list[dict]:
    """Cells where the live probe (✓/✗) and the slides (✓/✗) disagree; '?' and '–' never count."""
    out = []
    for row in table:
        if row["reduce_op"] != "SUM" or row["op"] not in SLIDES:
            continue
        for column in COLUMNS:
            live, slide = row[column], SLIDES[row["op"]][column]
            if live in "✓✗" and slide in "✓✗" and live != slide:
                out.append(
                    {
                        "op": row["op"],
                        "column": column,
                        "slides": slide,
                        "this torch": live,
                        "why": row[column + " why"] or "ran, and every rank held the right result",
                    }
                )
    return out


def side_by_side(table: list[dict]) -> list[dict]:
    """One row per probe, each column 'live / slides' ('≠' where they disagree), for a table.

    Reduction rows (all_reduce AVG, ...) are not in the slides: their cells show '/ n.a.'.
    """
    rows = []
    for row in table:
        sum_row = row["reduce_op"] == "SUM"
        out = {"op": row["op"] if sum_row else f"{row['op']} {row['reduce_op']}"}
        for column in COLUMNS:
            live = row[column]
            slide = SLIDES[row["op"]][column] if sum_row else "n.a."
            differs = live in "✓✗" and slide in "✓✗" and live != slide
            out[column] = f"{live} / {slide}" + (" ≠" if differs else "")
        rows.append(out)
    return rows


def untried(table: list[dict]) -> dict:
    """{column: why it could not be probed on this machine} for the columns shown as '–'."""
    first = table[0]
    return {c: first[c + " why"] for c in COLUMNS if first[c] == "–"}

"""``coordinator report DIR``: a job's compile as a whole, from every rank's trace.

Reads each ``rank<R>-<pid>.json`` a traced job wrote into ``DIR`` (``coordinator.observe.trace``;
a file cut short by a killed rank is read up to its last whole event) and writes, into
``DIR``:

* ``job.trace.json``: one Chrome trace with a row per rank (open it in Perfetto or
  chrome://tracing);
* ``job.png`` and ``job.svg``: a bar per rank through time, coloured by what the rank was
  doing for the coordinator (compiling, compiling its share of a split frame, waiting on
  another rank, loading, compiling backward graphs early), with a mark where each optimizer
  step ended. Drawing needs matplotlib (``pip install "torch-compile-coordinator[plot]"``);
  without it the trace and the table are still written.

It returns (and the command prints) a table per rank, with a legend: graphs compiled,
received, found locally, waits, time saved, bytes, rejections, counted from the rank's
events by the same function the rank's own summary counts them with (``Stats.count``), so
the two agree; where DDPOptimizer split frames, a table per frame (its graphs, the shares
compiled for the job, how many of the chains' lookups were served and missed, and the
seconds spent on its shares and on its chains, each over all ranks). And warnings: ranks
that compiled or received different sets of FX graphs (a rank that compiles a graph its
peers never need usually took another path through the model, the usual cause of a
collective that hangs), and waits on a rank that never compiled or published the graph.
Where ranks ran Triton kernels outside Inductor, a table of those per rank (kernels
compiled and received, tunings run and received) and the kind of GPU each rank's tunings
were shared within (``coordinator.features.triton_kernels``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from collections import defaultdict
from pathlib import Path

from coordinator.observe.stats import Counts, Stats

log = logging.getLogger(__name__)

_RANK_FILE = re.compile(r"rank(\d+)-\d+\.json$")
#: What each span means in the picture, drawn in this order (later on top), and its colour.
_DRAWN = {"receive": ("loading", "tab:green"), "compile": ("compiling", "tab:blue"),
          "share": ("its share of a split frame", "tab:cyan"), "early backward": ("early backward", "tab:purple"),
          "wait": ("waiting", "tab:orange")}


#: Each count of a rank's row, and the key of ``Stats.as_dict`` it is read from.
_FROM_STATS = {"compiled": "graphs_compiled", "received": "graphs_received",
               "local_hits": "graphs_found_in_local_cache", "waits": "waits", "waited_s": "waited_s",
               "saved_s": "compile_time_saved_s", "bytes_received": "bytes_received",
               "bytes_published": "bytes_published", "rejected": "rejected",
               "shares": "split_graphs_compiled_for_the_job"}


class RankRow(Counts, compiled=0, received=0, local_hits=0, waits=0, waited_s=0.0, saved_s=0.0, bytes_received=0,
              bytes_published=0, rejected=0, shares=0, first_step_s=None):
    """One rank's line of the report (``first_step_s``: seconds from the job's first event
    to this rank's step 1)."""

    rank: int


class FrameRow(Counts, graphs=0, compiled=0, served=0, missed=0, shares_s=0.0, chains_s=0.0):
    """One split frame of the job, over its ranks (``coordinator.features.split_shares``):
    its submodules (``graphs``: the most any rank's chain looked up); submodules
    ``compiled`` for the job (shares); chain lookups that found the entry (``served``) and
    that compiled the submodule instead (``missed``); the seconds the ranks spent on their
    shares of it (``shares_s``) and those of its chains (``chains_s``: every submodule looked
    up, waited for, loaded or compiled); each over all ranks."""

    frame: int


class ShareRow(Counts, dealt=0, compiled=0, taken=0, share_s=0.0, chain_s=0.0, waited_s=0.0):
    """One rank's part of one split frame: the submodules the deal gave it (``dealt``), those
    it ``compiled`` for the job (``taken`` of them from other ranks' deals once its own were
    done), the seconds of its share (``share_s``) and of its chain (``chain_s``), ``waited_s``
    of those waiting on other ranks' shares. An imbalance shows as one rank's ``share_s``
    against the others' ``waited_s``."""

    frame: int
    rank: int


class TritonRow(Counts, compiled=0, received=0, tuned=0, tunings_received=0, device=str):
    """One rank's Triton kernels outside Inductor: kernels compiled and received, tunings run
    and received; ``device``: the kind of GPU its tunings are shared within (only ranks on
    that kind share a tuning)."""

    rank: int


@dataclasses.dataclass
class Report:
    rows: list[RankRow]
    warnings: list[str]
    written: list[Path]
    notes: list[str] = dataclasses.field(default_factory=list)
    frames: list[FrameRow] = dataclasses.field(default_factory=list)
    shares: list[ShareRow] = dataclasses.field(default_factory=list)
    triton: list[TritonRow] = dataclasses.field(default_factory=list)

    def triton_table(self) -> str:
        """Per rank, its Triton kernels outside Inductor (empty: no rank ran any)."""
        if not self.triton:
            return ""
        lines = ["triton kernels outside Inductor:  rank  compiled  received  tuned  received  tunings shared within"]
        lines += [f"{'':34}{r.rank:>4}  {r.compiled:>8}  {r.received:>8}  {r.tuned:>5}  {r.tunings_received:>8}  "
                  f"{r.device or '-'}" for r in self.triton]
        return "\n".join(lines)

    def frame_table(self) -> str:
        """Per split frame: its graphs, the shares compiled for the job, and the chains'
        lookups served and missed, over all ranks; then each rank's part of each frame
        (empty: no frame was split)."""
        if not self.frames:
            return ""
        lines = ["split frames (all ranks):  frame  graphs  compiled  served  missed  shares_s  chains_s"]
        lines += [f"{'':26}{f.frame:>5}  {f.graphs:>6}  {f.compiled:>8}  {f.served:>6}  {f.missed:>6}  "
                  f"{f.shares_s:>8.1f}  {f.chains_s:>8.1f}" for f in self.frames]
        if self.shares:
            lines.append("split frames per rank:     frame  rank  dealt  compiled  taken  share_s  chain_s  waited_s")
            lines += [f"{'':26}{r.frame:>5}  {r.rank:>4}  {r.dealt:>5}  {r.compiled:>8}  {r.taken:>5}  "
                      f"{r.share_s:>7.1f}  {r.chain_s:>7.1f}  {r.waited_s:>8.1f}" for r in self.shares]
        return "\n".join(lines)

    def table(self) -> str:
        lines = ["  ".join(f"{h:>8}" for h in LEGEND)]
        for r in self.rows:
            cells = (r.rank, r.compiled, r.received, r.local_hits, r.waits, f"{r.waited_s:.1f}", f"{r.saved_s:.1f}",
                     f"{r.bytes_received / 1e6:.2f}", f"{r.bytes_published / 1e6:.2f}", r.rejected, r.shares,
                     "-" if r.first_step_s is None else f"{r.first_step_s:.1f}")
            lines.append("  ".join(f"{c:>8}" for c in cells))
        return "\n".join(lines)

    @staticmethod
    def legend(columns: dict[str, str] | None = None) -> str:
        """What each column of :meth:`table` counts (the rank's summary line says the same),
        or of ``columns`` (:data:`FRAME_LEGEND`: :meth:`frame_table`'s)."""
        return "\n".join(f"  {column:<10}{meaning}" for column, meaning in (columns or LEGEND).items())


#: The table's columns and what each counts.
LEGEND = {
    "rank": "the rank",
    "compiled": "FX graphs this rank compiled",
    "received": "FX graphs it loaded from the store or from this node's copy, compiled by another rank",
    "local": "FX graphs it found in its own Inductor cache dir (a warm rank, or local ranks sharing the dir)",
    "waits": "waits on another process's work: a compile (on the store), or a local rank's fetch (node lock)",
    "waited_s": "seconds in those waits (work done meanwhile, such as early backward compiles, not counted)",
    "saved_s": "compile seconds this rank did not spend: those recorded with the graphs it loaded (store, "
               "node copy, bundle)",
    "MB_in": "MB fetched from the store (reads of this node's copy not counted)",
    "MB_out": "MB this rank published to the store",
    "rejected": "values that failed verification (checksum, signature, key)",
    "shares": "split graphs it compiled for the job: its share of the frames DDPOptimizer split",
    "step1_s": "seconds from the job's first coordinator event to the end of this rank's first optimizer step",
}

#: The split-frame tables' columns (:meth:`Report.frame_table`) and what each counts.
FRAME_LEGEND = {
    "frame": "a frame DDPOptimizer split into submodules, in the order the ranks compiled them",
    "graphs": "its submodules' graphs (forward and backward)",
    "compiled": "of those, the ones compiled for the job in ranks' shares",
    "served": "chain lookups (the frame's run through its submodules) that found the entry a share published",
    "missed": "chain lookups that found none and compiled the submodule in the chain",
    "shares_s": "seconds the ranks spent compiling their shares (summed)",
    "chains_s": "seconds the ranks' chains took, the lookups' waits included (summed)",
    "rank": "the rank",
    "dealt": "submodules dealt to this rank by the frame's measured costs",
    "taken": "submodules this rank took from another rank's deal, nobody having started them",
    "share_s": "seconds this rank spent compiling its share",
    "chain_s": "seconds its chain took",
    "waited_s": "seconds its chain waited for another rank's share",
}


def read_events(path: Path) -> list[dict]:
    """The events of one rank's file; a file cut short ends at its last whole event."""
    events = []
    for line in path.read_text().splitlines():
        line = line.strip().rstrip(",")
        if line in ("[", "]", ""):
            continue
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            log.warning("%s: skipping an unreadable line (a rank killed while writing?)", path)
    return events


def load_traces(trace_dir: Path) -> dict[int, list[dict]]:
    """Every rank's events in ``trace_dir`` (a rank restarted in place has several files),
    in time order."""
    traces: dict[int, list[dict]] = defaultdict(list)
    for path in sorted(trace_dir.iterdir()):
        match = _RANK_FILE.fullmatch(path.name)
        if match:
            traces[int(match.group(1))].extend(read_events(path))
    for events in traces.values():
        events.sort(key=lambda e: e.get("ts", 0))
    return dict(sorted(traces.items()))


def _timed(events: list[dict]) -> list[dict]:
    return [e for e in events if e.get("ph") != "M"]


def job_start(traces: dict[int, list[dict]]) -> float:
    """The first event's time, in microseconds."""
    return min((e["ts"] for events in traces.values() for e in _timed(events)), default=0.0)


def graphs_needed(events: list[dict]) -> dict[str, str]:
    """The FX graphs a rank compiled, received (from the store or its node's copy) or found
    in its local cache (which local ranks may share): key -> how."""
    how = {"compile": "compiled it", "receive": "received it", "local hit": "found it in its local cache"}
    needed: dict[str, str] = {}
    for e in events:
        key = e.get("args", {}).get("key", "")
        if e["name"] in how and key.startswith("fx_graph/"):
            needed.setdefault(key, how[e["name"]])
    return needed


def rows(traces: dict[int, list[dict]]) -> list[RankRow]:
    """Each rank's row: its events counted as its own session counted them (``Stats.count``)."""
    start = job_start(traces)
    table = []
    for rank, events in traces.items():
        stats = Stats(rank)
        first_step_s = None
        for e in events:
            stats.count(e)
            if e["name"] == "step" and e.get("args", {}).get("n") == 1:
                first_step_s = (e["ts"] - start) / 1e6
        d = stats.as_dict()
        table.append(RankRow(rank, first_step_s=first_step_s, **{count: d[key] for count, key in _FROM_STATS.items()}))
    return table


def triton_rows(traces: dict[int, list[dict]]) -> list[TritonRow]:
    """Each rank's Triton kernels outside Inductor, where any rank ran one."""
    table = []
    for rank, events in traces.items():
        stats = Stats(rank)
        device = ""
        for e in events:
            stats.count(e)
            if e["name"] == "triton device":
                device = e.get("args", {}).get("device", "")
        d = stats.as_dict()
        table.append(TritonRow(rank, compiled=d["triton_kernels_compiled"], received=d["triton_kernels_received"],
                               tuned=d["triton_tunings_run"], tunings_received=d["triton_tunings_received"],
                               device=device))
    return table if any(r.compiled or r.received or r.tuned or r.tunings_received for r in table) else []


def split_frames(traces: dict[int, list[dict]]) -> list[FrameRow]:
    """Per split frame, over all ranks: shares compiled, the chains' lookups served and
    missed, the seconds spent on shares and on chains."""
    frames: dict[int, FrameRow] = {}
    per_rank: dict[tuple[int, int], set[int]] = defaultdict(set)
    for rank, events in traces.items():
        for event in events:
            args = event.get("args", {})
            if event.get("name") not in ("share", "chain", "split frame") or "frame" not in args:
                continue
            row = frames.setdefault(args["frame"], FrameRow(args["frame"]))
            if event["name"] == "split frame":
                row.shares_s += args.get("share_s", 0.0)
                row.chains_s += args.get("chain_s", 0.0)
                continue
            if event["name"] == "share":
                row.compiled += args.get("outcome") == "compiled"
                continue
            per_rank[(rank, args["frame"])].add(args.get("index", 0))
            if args.get("outcome") == "served":
                row.served += 1
            else:
                row.missed += 1
    for (_, frame), indices in per_rank.items():
        frames[frame].graphs = max(frames[frame].graphs, len(indices))
    return [frames[n] for n in sorted(frames)]


def split_frame_shares(traces: dict[int, list[dict]]) -> list[ShareRow]:
    """Each rank's part of each split frame, from its "split frame" events, by frame then rank."""
    found = []
    for rank, events in traces.items():
        for event in events:
            args = event.get("args", {})
            if event.get("name") == "split frame" and "frame" in args:
                found.append(ShareRow(frame=args["frame"], rank=rank, dealt=args.get("dealt", 0),
                                      compiled=args.get("compiled", 0), taken=args.get("taken", 0),
                                      share_s=args.get("share_s", 0.0), chain_s=args.get("chain_s", 0.0),
                                      waited_s=args.get("waited_s", 0.0)))
    return sorted(found, key=lambda row: (row.frame, row.rank))


def _ranks(ranks) -> str:
    ranks = sorted(ranks)
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def divergence(traces: dict[int, list[dict]], limit: int = 10) -> list[str]:
    """A warning per FX graph that some ranks needed and others did not."""
    needed = {rank: graphs_needed(events) for rank, events in traces.items()}
    every_key = sorted(set().union(*needed.values())) if needed else []
    warnings = []
    for key in every_key:
        having = [rank for rank in needed if key in needed[rank]]
        if len(having) == len(needed):
            continue
        lacking = [rank for rank in needed if key not in needed[rank]]
        how = "; ".join(f"rank {rank} {needed[rank][key]}" for rank in having)
        warnings.append(f"graph {key} was needed by {_ranks(having)} only ({how}); {_ranks(lacking)} never "
                        "needed it: ranks that compile different graphs can hang in a collective")
    if len(warnings) > limit:
        warnings = warnings[:limit] + [f"... and {len(warnings) - limit} more graphs not needed by every rank"]
    return warnings


def unmatched_waits(traces: dict[int, list[dict]]) -> list[str]:
    """A warning per wait on a rank that has no compile or publish of that key."""
    made = {rank: {e["args"]["key"] for e in events if e["name"] in ("compile", "publish", "share")}
            for rank, events in traces.items()}
    warnings = []
    for rank, events in traces.items():
        for e in events:
            if e["name"] != "wait" or e["args"].get("via") == "node lock":  # on a process of its node
                continue
            key, owner = e["args"]["key"], e["args"].get("owner")
            if owner is None and e["args"].get("ended") == "received":
                continue  # published before the waiter read who held it: nobody to check
            if owner not in made or key not in made[owner]:
                warnings.append(f"rank {rank} waited {e.get('dur', 0) / 1e6:.1f}s on {key} held by rank {owner}, "
                                f"which has no compile or publish of it in the trace ({e['args'].get('ended')})")
    return warnings


def merged_trace(traces: dict[int, list[dict]]) -> dict:
    """One Chrome trace object, a process (row) per rank."""
    events = [e for rank_events in traces.values() for e in rank_events]
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"ranks": sorted(traces)}}


def draw(traces: dict[int, list[dict]], paths: list[Path]) -> bool:
    """Draw the job's start into ``paths`` (by suffix: .png, .svg); False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    start = job_start(traces)
    ranks = list(traces)
    fig, ax = plt.subplots(figsize=(10, 1.2 + 0.45 * len(ranks)))
    for y, rank in enumerate(ranks):
        spans = [e for e in traces[rank] if e.get("ph") == "X" and e["name"] in _DRAWN]
        for name, (_, colour) in _DRAWN.items():
            named = [e for e in spans if e["name"] == name]
            bars = [((e["ts"] - start) / 1e6, e["dur"] / 1e6) for e in named]
            ax.broken_barh(bars, (y - 0.35, 0.7), facecolors=colour)
            for e, (x, width) in zip(named, bars, strict=True):
                if name == "wait" and e["args"].get("owner") is not None:
                    ax.text(x + width / 2, y, f"r{e['args']['owner']}", ha="center", va="center", fontsize=7)
        for e in traces[rank]:
            if e["name"] == "step":
                x = (e["ts"] - start) / 1e6
                ax.plot([x, x], [y - 0.45, y + 0.45], color="black", linewidth=1.5 if e["args"]["n"] == 1 else 0.6)
                if e["args"]["n"] == 1:
                    ax.text(x, y - 0.47, "step 1", fontsize=7, ha="center", va="bottom")
    ax.set_yticks(range(len(ranks)), [f"rank {rank}" for rank in ranks])
    ax.set_ylim(-0.8, len(ranks) - 0.2)
    ax.invert_yaxis()
    ax.set_xlabel("seconds from the job's first coordinator event")
    handles = [matplotlib.patches.Patch(color=colour, label=label) for label, colour in _DRAWN.values()]
    handles.append(matplotlib.lines.Line2D([], [], color="black", label="optimizer step ended"))
    ax.set_title(f"compile_once: {len(ranks)} ranks, who compiled and who waited on whom (r<N>: waited on rank N)",
                 fontsize=9)
    fig.tight_layout()
    fig.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=5, fontsize=8, frameon=False)
    for path in paths:
        fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return True


def write_report(trace_dir: Path, *, picture: bool = True) -> Report:
    """Merge ``trace_dir``'s rank files and write the trace (and the picture).

    Raises:
        FileNotFoundError: no rank's trace is there.
    """
    trace_dir = Path(trace_dir)
    traces = load_traces(trace_dir) if trace_dir.is_dir() else {}
    if not traces:
        raise FileNotFoundError(f"no rank traces (rank<R>-<pid>.json) in {trace_dir}")
    merged = trace_dir / "job.trace.json"
    merged.write_text(json.dumps(merged_trace(traces)))
    written = [merged]
    report = Report(rows(traces), divergence(traces) + unmatched_waits(traces), written,
                    frames=split_frames(traces), shares=split_frame_shares(traces), triton=triton_rows(traces))
    if picture:
        pictures = [trace_dir / "job.png", trace_dir / "job.svg"]
        if draw(traces, pictures):
            written += pictures
        else:
            report.notes.append("no picture: matplotlib is not installed "
                                '(pip install "torch-compile-coordinator[plot]")')
    return report

"""Per-step telemetry: rt.stats()["last_step"], and one log line per step when asked (Config.log_every).

A step is the time from one opt.step() to the next. Its wall time splits into the training thread's waits
per queue (telemetry.Queue) and compute (the rest); each lane reports its busy time; each link the bytes it
moved and the bandwidth it achieved while busy; each tier its occupancy; the compute device's allocator its peak
so far (`device_peak_bytes`, device_memory.peak_allocated: on a GPU max_memory_allocated, whose statistics the runtime
never resets: a user's own peak measurement stays theirs), and the process's peak resident set so far
(`peak_rss_bytes`); `throughput`: the window's tokens, tokens/s, model TFLOPS and MFU (offload/throughput.py:
6 x params x tokens / s, attention not counted), from the training forwards of the wrapped models (`tokens`).
Background work of a step (the optimizer's write-behind) lands in the next step's window: in steady state the
sums are per step.
"""
from __future__ import annotations

import logging
import time

from ..device_memory import peak_allocated
from ..store import format_bytes
from ..throughput import TokenCounter, figures
from .host_memory import peak_rss_bytes

log = logging.getLogger("offload")


class StepStats:
    def __init__(self, meter, states, counters, device, log_every: int = 0):
        self.meter = meter
        self.device = device  # the compute device, whose allocator's peak so far each step reports
        self.states = states
        self.counters = counters
        self.log_every = log_every
        self.steps = 0
        self.last: dict | None = None
        self.tokens = TokenCounter()  # the wrapped models' training forwards (wrap.py watches each)
        self._mark = self._snapshot()

    def _snapshot(self):
        s = self.states.stats()
        return (self.meter.snapshot(), dict(s["moved"]), dict(s["busy_s"]),
                (self.counters.allgather_bytes, self.counters.reduce_scatter_bytes))

    def end_step(self, skipped: bool = False) -> dict:
        """The window since the last step's end becomes `last`. skipped: a step offload.GradScaler skipped for an
        overflow (`last` says so; `steps`, the optimizer steps taken, stays)."""
        now = self._snapshot()
        meter, moved, busy, comm = now
        m0, moved0, busy0, comm0 = self._mark
        self._mark = now
        d = meter.minus(m0)
        waits = {q.value: round(v, 6) for q, v in d.wait_s.items() if v > 0}
        links = {}
        for link, nbytes in moved.items():
            b, s = nbytes - moved0.get(link, 0), busy[link] - busy0.get(link, 0.0)
            if b:
                links[link] = {"bytes": b, "busy_s": round(s, 6), "GBps": round(b / s / 1e9, 3) if s > 0 else None}
        tiers = self.states.stats()
        tokens, flops = self.tokens.take()
        self.steps += 0 if skipped else 1
        self.last = {
            "step": self.steps,
            "skipped": skipped,
            "wall_s": round(d.at, 6),
            "compute_s": round(max(0.0, d.at - sum(d.wait_s.values())), 6),
            "wait_s": waits,
            "lane_busy_s": {lane.value: round(v, 6) for lane, v in d.busy_s.items() if v > 0},
            "links": links,
            "allgather_bytes": comm[0] - comm0[0],
            "reduce_scatter_bytes": comm[1] - comm0[1],
            "device_peak_bytes": peak_allocated(self.device),
            "peak_rss_bytes": peak_rss_bytes(),
            "throughput": figures(tokens, flops, d.at, self.device),
            "occupancy": {t: {"bytes_in_use": tiers[t]["bytes_in_use"], "peak_bytes": tiers[t]["peak_bytes"],
                              "capacity": tiers[t]["capacity"]} for t in ("device", "cpu")},
        }
        if self.log_every and not skipped and self.steps % self.log_every == 0:
            log.info(self.line())
        return self.last

    def line(self) -> str:
        s = self.last
        waits = " ".join(f"{q} {v:.3f}" for q, v in sorted(s["wait_s"].items(), key=lambda x: -x[1]))
        links = " ".join(f"{k} {format_bytes(v['bytes'])}" + (f" @{v['GBps']:.2f}GB/s" if v["GBps"] else "")
                         for k, v in s["links"].items())
        cpu = s["occupancy"]["cpu"]
        device = "" if s["device_peak_bytes"] is None else f" | device peak {format_bytes(s['device_peak_bytes'])}"
        return (f"offload step {s['step']}: {s['wall_s']:.3f}s = compute {s['compute_s']:.3f}s + waits [{waits}] | "
                f"{throughput_text(s['throughput'])}{links} | cpu tier {format_bytes(cpu['bytes_in_use'])}/"
                f"{format_bytes(cpu['capacity'])} (peak {format_bytes(cpu['peak_bytes'])}){device} | "
                f"peak RSS {format_bytes(s['peak_rss_bytes'])} | {time.strftime('%H:%M:%S')}")


def throughput_text(t: dict) -> str:
    """"2048 tok/s, 41.2 TFLOPS (MFU 4.2%) | ", or "" when the window counted no tokens."""
    if not t.get("tokens_per_s"):
        return ""
    mfu = f" (MFU {100 * t['mfu']:.1f}%)" if t.get("mfu") is not None else ""
    return f"{t['tokens_per_s']:.0f} tok/s, {t['model_tflops']:.3g} TFLOPS{mfu} | "

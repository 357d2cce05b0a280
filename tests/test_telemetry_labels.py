"""Profiler labels (telemetry.span): present in torch's profiler and in the runtime's trace when either records,
and not opened when neither does (a label costs about 6 us of CPU, and the runtime opens several a unit a step:
issue 42's per-unit overhead)."""
from __future__ import annotations

import torch

from offload import telemetry
from offload.telemetry import Lane, span


def test_a_span_is_a_profiler_label_while_torch_profiles():
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with span("probe", Lane.GATHER):
            torch.ones(4).add_(1)
    assert "offload::probe" in {e.name for e in prof.events()}


def test_a_span_is_a_trace_event_while_a_trace_records():
    telemetry.start_trace()
    try:
        with span("probe", Lane.REDUCE):
            pass
    finally:
        events = telemetry.stop_trace()
    assert [(e["name"], e["tid"]) for e in events] == [("probe", "reduce")]


def test_a_span_opens_no_profiler_label_when_nothing_records(monkeypatch):
    opened = []
    real = torch.profiler.record_function

    def counting(name, *args):
        opened.append(name)
        return real(name, *args)

    monkeypatch.setattr(torch.profiler, "record_function", counting)
    assert not telemetry.tracing()
    for _ in range(3):
        with span("probe"):
            pass
    assert opened == []

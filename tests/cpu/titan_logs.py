"""TorchTitan's per-step log lines, written by its own metrics code: what the A/B report
parses, for tests of the A/B scripts (0.2.2's here; tests/cpu_torchtitan03 writes 0.3.0's)."""

import logging
from types import SimpleNamespace

import torchtitan.components.metrics as titan_metrics
from torchtitan.tools.utils import Color


class _Capture(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def titan_step_message(monkeypatch, step, loss, memory_gib, tps):
    """The line TorchTitan's own MetricsProcessor.log prints, from stubbed inputs."""
    step_time = 2.0
    monkeypatch.setattr(titan_metrics, "time", SimpleNamespace(perf_counter=lambda: step_time))
    processor = titan_metrics.MetricsProcessor.__new__(titan_metrics.MetricsProcessor)
    processor.num_flops_per_token = 6e9
    processor.gpu_peak_flops = 989e12
    processor.parallel_dims = SimpleNamespace(non_data_parallel_size=1)
    processor.job_config = SimpleNamespace(metrics=SimpleNamespace(log_freq=1))
    processor.time_last_log = 0.0
    processor.ntokens_since_last_log = int(tps * step_time)
    processor.data_loading_times = [0.01]
    stats = SimpleNamespace(
        max_active_gib=memory_gib, max_active_pct=10.0, max_reserved_gib=memory_gib,
        max_reserved_pct=25.0, num_alloc_retries=0, num_ooms=0,
    )
    processor.device_memory_monitor = SimpleNamespace(
        get_peak_stats=lambda: stats, reset_peak_stats=lambda: None
    )
    processor.logger = SimpleNamespace(log=lambda metrics, step: None)
    processor.color = Color()
    capture = _Capture()
    root = logging.getLogger()
    root.addHandler(capture)
    level = root.level
    root.setLevel(logging.INFO)
    try:
        processor.log(step, loss, loss, 1.25)
    finally:
        root.removeHandler(capture)
        root.setLevel(level)
    (message,) = capture.messages
    return message


def synthetic_log(monkeypatch, step_time_s, losses, memory, tps, total_steps=None,
                  step_message=titan_step_message) -> str:
    """A torchrun-teed rank-0 log as TorchTitan writes it, each step line from
    ``step_message(monkeypatch, step, loss, memory_gib, tps)`` (0.2.2's by default)."""
    total_steps = total_steps or len(losses)
    prefix = "[rank0]:[titan] 2025-03-01 {} - root - INFO - "

    def stamp(seconds):
        minutes, rest = divmod(seconds, 60)
        return f"10:{int(minutes):02d}:{int(rest):02d},{round(rest % 1 * 1000):03d}"

    lines = [
        prefix.format(stamp(0)) + "Building qwen3 debugmodel_moe",
        prefix.format(stamp(1)) + "Trainer is initialized with local batch size 1, global batch size 2, "
        f"gradient accumulation steps 1, sequence length 16384, total steps {total_steps} (warmup 2)",
    ]
    for i, loss in enumerate(losses):
        step = i + 1
        message = step_message(monkeypatch, step, loss, memory[i], tps[i])
        lines.append(prefix.format(stamp(10 + step * step_time_s)) + message)
        if step == 3:
            lines.append(prefix.format(stamp(10 + step * step_time_s)) + f"{Color.yellow}validate step:  3  "
                         f"{Color.green}loss:  9.0000  {Color.turquoise}memory:  1.00GiB(1.00%)  "
                         f"{Color.blue}tps: 1{Color.reset}")
    lines.append("[rank0]:[titan] 2025-03-01 10:09:00,000 - root - INFO - Training completed")
    return "\n".join(lines) + "\n"

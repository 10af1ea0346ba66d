"""GET /metrics: the live table (live.py) in Prometheus' text format, read at scrape time.

Every value is rendered under the project's name (gpt2_*) and, where vLLM has one, under vLLM's
name too, labelled model_name, so vLLM's example Grafana dashboard works unchanged. Both come
from the same reading of the same table: they can never disagree.
"""

import time
from collections.abc import Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from batching.telemetry.histograms import HISTOGRAMS
from batching.telemetry.live import LIVE_VALUES, LiveTable, Reading
from batching.telemetry.step_summary import StepSummary


def render(
    live: LiveTable, values: dict[str, Reading], steps: StepSummary, infos: list[Metric] = ()
) -> tuple[bytes, str]:
    """The scrape of the live table's `values` (one reading, cut to what the reader may see) and its histograms,
    with `infos` (vLLM's *_info series)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Scrape(live, values, steps, infos))
    return generate_latest(registry), CONTENT_TYPE_LATEST


def lora_requests_info(model: str, running: list[str], waiting: list[str], max_lora: int) -> Metric:
    """vLLM's vllm:lora_requests_info: the adapters of running and waiting requests (comma-separated names)
    and MAX_LORAS as labels; its value is the time of the reading, as vLLM sets it. With model_name too,
    as every vllm: series here."""
    labels = ["model_name", "max_lora", "waiting_lora_adapters", "running_lora_adapters"]
    family = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on LoRA requests.", labels=labels)
    family.add_metric([model, str(max_lora), ",".join(waiting), ",".join(running)], time.time())
    return family


def cache_config_info(model: str, block_size: int, cache_dtype: str, prefix_cache: bool, num_blocks: int) -> Metric:
    """vLLM's vllm:cache_config_info: the KV cache's configuration as labels (vLLM's names for a subset of its
    CacheConfig's fields, and its engine index, 0), value 1. With model_name too, as every vllm: series here."""
    labels = ["model_name", "block_size", "cache_dtype", "enable_prefix_caching", "num_gpu_blocks", "engine"]
    family = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig", labels=labels)
    family.add_metric([model, str(block_size), cache_dtype, str(prefix_cache), str(num_blocks), "0"], 1)
    return family


class _Scrape(Collector):
    def __init__(self, live: LiveTable, values: dict[str, Reading], steps: StepSummary, infos: list[Metric]) -> None:
        self.live, self.values, self.steps, self.infos = live, values, steps, infos

    def collect(self) -> Iterator[Metric]:
        values, model = self.values, self.live.model_name
        for row in LIVE_VALUES:
            if row.metric:
                yield _family(row.metric, row.kind, row.help, values[row.key], row.label)
            for name in row.vllm:
                yield _family(name, row.kind, row.help, values[row.key], row.label, model)
        readings = self.live.histogram_readings()
        for spec in HISTOGRAMS:
            buckets, total = readings[spec.key]
            names = ((spec.metric, None),) if spec.metric else ()
            for name, model_name in (*names, *((v, model) for v in spec.vllm)):
                labels = ["model_name"] if model_name else []
                family = HistogramMetricFamily(name, spec.help, labels=labels)
                family.add_metric([model_name] if model_name else [], buckets, total)
                yield family
        yield from _recent_steps(self.steps)
        yield from self.infos


def _family(name: str, kind: str, help: str, value: Reading, label: str | None, model: str | None = None) -> Metric:
    """One gauge or counter; with `model`, labelled model_name (vLLM's series)."""
    labels = (["model_name"] if model else []) + ([label] if label else [])
    family = (GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(name, help, labels=labels)
    prefix = [model] if model else []
    if label:
        for label_value, count in value.items():
            family.add_metric([*prefix, label_value], count)
    else:
        family.add_metric(prefix, value)
    return family


def _recent_steps(summary: StepSummary) -> Iterator[Metric]:
    """Gauges over the kept step records: a step-time histogram would cost the loop an observation per step."""
    yield GaugeMetricFamily(
        "gpt2_recent_steps",
        "Steps kept in the step log, which the gpt2_recent_step_* gauges summarise",
        value=summary.steps,
    )
    yield GaugeMetricFamily(
        "gpt2_recent_steps_with_prefill",
        "Of the recent steps, those that computed a prompt chunk",
        value=summary.steps_with_prefill,
    )
    step_time = GaugeMetricFamily("gpt2_recent_step_seconds", "Step time over the recent steps", labels=["stat"])
    for stat, seconds in summary.step_time_s.items():
        if seconds is not None:
            step_time.add_metric([stat], seconds)
    yield step_time
    stages = GaugeMetricFamily(
        "gpt2_recent_step_stage_seconds", "Mean seconds per recent step spent in each stage", labels=["stage"]
    )
    for stage, seconds in summary.stage_time_s.items():
        if seconds is not None:
            stages.add_metric([stage], seconds)
    yield stages

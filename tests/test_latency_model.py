"""The profiler and the latency model: the fit recovers known constants; on this CPU it predicts the real engine."""

import pytest
import torch

from benchmarks.latency_model import summary, validate
from config import EngineSettings
from model.gpt2 import PRESETS
from model.loader import load_model
from sim.cost import step_cost
from sim.profiler import Step, fit_constants, gpt2_profile, profile, prompt_tokens_per_s
from sim.profiles import GpuProfile, load_gpu, write_gpu_profile
from sim.profiles import load_model as load_model_profile

CPU = torch.device("cpu")


def test_gpt2_profile_is_the_models_toml_entry():
    for name, config in PRESETS.items():
        derived = gpt2_profile(name, config, torch.float16)
        assert derived == load_model_profile(name)


@pytest.mark.parametrize("overhead", [0.0, 0.003])
def test_the_fit_recovers_the_constants_that_made_the_steps(overhead):
    truth = GpuProfile(
        "truth",
        flops=2e11,
        bandwidth=1.5e10,
        memory_gib=8,
        compute_efficiency=1.0,
        bandwidth_efficiency=1.0,
        step_overhead_s=overhead,
    )
    model = gpt2_profile("gpt2", PRESETS["gpt2"], torch.float32)
    shapes = [((n, n),) for n in (16, 128, 1000)] + [((1, c),) * b for b in (1, 8, 32) for c in (64, 700)]
    steps = [Step(s, step_cost(truth, model, s).total_s) for s in shapes]
    fitted_overhead, flops, bandwidth = fit_constants(model, steps)
    assert fitted_overhead == pytest.approx(overhead, abs=1e-9)
    assert flops == pytest.approx(2e11, rel=1e-6) and bandwidth == pytest.approx(1.5e10, rel=1e-6)


def test_prompt_tokens_per_s_is_the_inverse_slope():
    prefill = [Step(((n, n),), 0.05 + n / 2000) for n in (16, 64, 256, 1024)]
    assert prompt_tokens_per_s(prefill) == pytest.approx(2000)


@pytest.fixture
def one_thread():
    """Profile and check on one core: a two-thread matmul slows by half whenever anything else takes a core,
    so fitting on one machine state and checking on another would compare different machines."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_profile_then_predict_the_real_engine_on_this_cpu(tmp_path, one_thread):
    """A small grid, generous bounds: docs/simulated-engine.md has the full grid and its figures."""
    settings = EngineSettings(device="cpu", dtype="float32")
    gpu, measured = profile("random:gpt2", "ci-cpu", settings, [16, 64, 256], [1, 4], [64, 256], repeats=2)
    assert measured["model"] == "random:gpt2" and measured["bytes_per_param"] == 4
    assert measured["prompt_tokens_per_s"] > 0 and len(measured["decode"]) == 4
    path = tmp_path / "ci-cpu.toml"
    write_gpu_profile(path, gpu, measured)
    assert load_gpu(str(path)) == gpu
    loaded = load_model("random:gpt2", CPU, torch.float32)
    rows = validate(gpu, loaded, prompts=[32, 128], responses=[8], batches=[1, 4], repeats=1)
    median, worst = summary(rows)
    assert median < 0.5 and worst < 1.0, rows

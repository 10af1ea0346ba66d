"""The cost model against hand-computed values; profiles against published sizes; the simulated KV pool."""

import pytest
import torch

from config import EngineSettings
from model.gpt2 import GPT, PRESETS
from sim.cost import attention_pairs, step_cost
from sim.memory import sim_kv_blocks
from sim.profiles import GpuProfile, ModelProfile, ProfileError, load_gpu, load_model, write_gpu_profile
from sim.simulate import simulate

# Round numbers, so every expected value below can be checked by hand.
TINY_GPU = GpuProfile(
    "tiny-gpu",
    flops=1e6,
    bandwidth=1e4,
    memory_gib=1,
    compute_efficiency=0.5,
    bandwidth_efficiency=0.5,
    step_overhead_s=0.01,
)
TINY_MODEL = ModelProfile(
    "tiny",
    n_layer=2,
    n_head=2,
    d_model=8,
    d_ff=32,
    vocab_size=100,
    context_len=64,
    learned_positions=0,
    gated_mlp=False,
    bias=False,
    norm="rmsnorm",
    tied_embeddings=True,
    bytes_per_param=2,
)
TINY_LAYER = 4 * 8 * 8 + 2 * 8 * 32 + 2 * 8  # q, k, v, o; up and down; two RMSNorm weights = 784
TINY_PARAMS = 2 * TINY_LAYER + 100 * 8 + 8  # layers, tied embedding, final norm = 2376
TINY_KV_PER_TOKEN = 2 * 2 * 8 * 2  # key and value, 2 layers, d_model 8, 2 bytes = 64


def test_tiny_model_sizes():
    assert TINY_MODEL.layer_params == TINY_LAYER == 784
    assert TINY_MODEL.num_params == TINY_PARAMS == 2376
    assert TINY_MODEL.weight_bytes == 2 * 2376
    assert TINY_MODEL.kv_bytes_per_token == TINY_KV_PER_TOKEN


def test_attention_pairs_are_causal():
    assert attention_pairs(4, 4) == 1 + 2 + 3 + 4
    assert attention_pairs(1, 10) == 10
    assert attention_pairs(3, 10) == 8 + 9 + 10  # the uncached tail of a prompt


def test_mixed_step_cost_by_hand():
    # A 4-token prefill beside one decode at context 10.
    flops = 2 * 2 * 784 * 5 + 2 * 100 * 8 * 2 + 4 * 2 * 8 * (10 + 10)  # blocks x 5 tokens, 2 logit rows, 20 pairs
    assert flops == 20_160
    nbytes = 2 * 2376 + 64 * (4 + 10) + 64 * 5  # weights, KV read, KV written
    assert nbytes == 5_968
    cost = step_cost(TINY_GPU, TINY_MODEL, [(4, 4), (1, 10)])
    assert cost.compute_s == pytest.approx(20_160 / 5e5)  # 0.04032
    assert cost.memory_s == pytest.approx(5_968 / 5e3)  # 1.1936
    assert cost.overhead_s == 0.01
    assert cost.total_s == pytest.approx(0.01 + 0.04032 + 1.1936)
    # Two GPUs halve compute and memory time, not the overhead.
    two = step_cost(TINY_GPU, TINY_MODEL, [(4, 4), (1, 10)], num_gpus=2)
    assert two.total_s == pytest.approx(0.01 + 0.02016 + 0.5968)


def test_a_mixed_step_costs_what_its_parts_cost_less_the_shared_weights_and_overhead():
    prefill, decode = [(4, 4)], [(1, 10)]
    both = step_cost(TINY_GPU, TINY_MODEL, prefill + decode).total_s
    apart = step_cost(TINY_GPU, TINY_MODEL, prefill).total_s + step_cost(TINY_GPU, TINY_MODEL, decode).total_s
    shared = 0.01 + 2 * 2376 / 5e3  # one overhead and one read of the weights saved
    assert both == pytest.approx(apart - shared)


def test_simulate_is_one_prefill_then_decodes_at_growing_context():
    p = simulate(TINY_GPU, TINY_MODEL, prompt_len=4, response_len=3, batch_size=2)
    assert p.prefill_s == step_cost(TINY_GPU, TINY_MODEL, [(4, 4)] * 2).total_s
    assert p.decode_s == [step_cost(TINY_GPU, TINY_MODEL, [(1, c)] * 2).total_s for c in (5, 6)]
    assert p.total_s == pytest.approx(p.prefill_s + sum(p.decode_s))


def test_llama_65b_decode_is_bound_by_reading_the_weights():
    gpu, model = load_gpu("a100-80gb"), load_model("llama-65b")
    cost = step_cost(gpu, model, [(1, 100)], num_gpus=2)
    weights_s = 2 * 65.29e9 / (2 * 2.039e12 * 0.6)  # fp16 weights over 2 GPUs' effective bandwidth
    assert cost.memory_s == pytest.approx(weights_s, rel=0.01)
    assert cost.compute_s < 0.01 * cost.memory_s


# Published sizes: GPT-2 model cards (124M, 355M, 774M, 1.5B), OPT paper table 1, LLaMA paper table 2.
PUBLISHED = {
    "gpt2": 124e6,
    "gpt2-medium": 355e6,
    "gpt2-large": 774e6,
    "gpt2-xl": 1.558e9,
    "opt-125m": 125e6,
    "opt-1.3b": 1.3e9,
    "opt-6.7b": 6.7e9,
    "opt-13b": 13e9,
    "opt-30b": 30e9,
    "llama-7b": 6.7e9,
    "llama-13b": 13.0e9,
    "llama-65b": 65.2e9,
}


@pytest.mark.parametrize(("name", "published"), PUBLISHED.items())
def test_parameter_counts_match_published_sizes(name, published):
    model = load_model(name)
    assert model.num_params == pytest.approx(published, rel=0.03)
    assert model.weight_bytes == 2 * model.num_params


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_gpt2_profiles_count_exactly_what_the_real_model_holds(name):
    with torch.device("meta"):
        real = GPT(PRESETS[name])
    unique = {id(p): p.numel() for p in real.parameters()}  # the LM head is tied to wte
    model = load_model(name)
    assert model.num_params == sum(unique.values())
    assert model.kv_bytes_per_token == PRESETS[name].kv_bytes_per_token(torch.float16)
    assert model.context_len == PRESETS[name].n_positions


def test_opt_125m_is_a_quarter_gigabyte_not_250_gigabytes():
    assert load_model("opt-125m").weight_bytes == pytest.approx(250e6, rel=0.03)


def test_kv_pool_is_memory_minus_weights():
    settings = EngineSettings(block_size=16)
    free = 0.9 * 2**30 - 2 * 2376  # 90% of 1 GiB, less the weights
    assert sim_kv_blocks(settings, TINY_GPU, TINY_MODEL, 1) == int(free // (64 * 16))
    free_two = 0.9 * 2 * 2**30 - 2 * 2376
    assert sim_kv_blocks(settings, TINY_GPU, TINY_MODEL, 2) == int(free_two // (64 * 16))
    assert sim_kv_blocks(EngineSettings(block_size=16, kv_cache_blocks=7), TINY_GPU, TINY_MODEL, 1) == 7
    assert sim_kv_blocks(EngineSettings(block_size=16, kv_cache_gb=1.0), TINY_GPU, TINY_MODEL, 1) == 2**30 // 1024


def test_llama_65b_needs_two_a100s():
    gpu, model = load_gpu("a100-80gb"), load_model("llama-65b")
    with pytest.raises(ProfileError, match="does not fit.*SIM_NUM_GPUS to at least 2"):
        sim_kv_blocks(EngineSettings(), gpu, model, 1)
    # 2 x 80 GiB x 90%, less 65.29e9 fp16 weights, in blocks of 16 tokens x 2 (K, V) x 80 layers x 8192 x 2 bytes
    blocks = sim_kv_blocks(EngineSettings(block_size=16), gpu, model, 2)
    assert blocks == int((0.9 * 2 * 80 * 2**30 - model.weight_bytes) // (16 * 2 * 80 * 8192 * 2))
    assert 500 < blocks < 650  # ~9,000 tokens of cache: memory pressure comes early


def test_a_pool_smaller_than_one_context_is_an_error():
    cramped = GpuProfile("cramped", 1e6, 1e4, (2 * 2376 + 1000) / 0.9 / 2**30, 0.5, 0.5, 0.01)
    with pytest.raises(ProfileError, match="less than one 64-token context"):
        sim_kv_blocks(EngineSettings(block_size=16), cramped, TINY_MODEL, 1)


def test_profile_files_round_trip_and_bad_ones_are_named(tmp_path):
    path = tmp_path / "mine.toml"
    write_gpu_profile(path, TINY_GPU, {"device": "cpu", "prefill": [[16, 0.5], [32, 1.0]], "fitted": float("inf")})
    assert load_gpu(str(path)) == TINY_GPU
    (tmp_path / "two.toml").write_text("[a]\nflops = 1\n[b]\nflops = 2\n")
    with pytest.raises(ProfileError, match="exactly one GPU table"):
        load_gpu(str(tmp_path / "two.toml"))
    (tmp_path / "short.toml").write_text("[a]\nflops = 1e12\n")
    with pytest.raises(ProfileError, match="lacks bandwidth"):
        load_gpu(str(tmp_path / "short.toml"))
    with pytest.raises(ProfileError, match="unknown GPU 'a100-8gb'"):
        load_gpu("a100-8gb")
    with pytest.raises(ProfileError, match="unknown model 'llama-70b'"):
        load_model("llama-70b")


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (dict(engine="vllm"), "ENGINE must be one of gpt2, sim"),
        (dict(sim_num_gpus=0), "SIM_NUM_GPUS must be at least 1"),
        (dict(sim_model=""), "SIM_MODEL and SIM_GPU"),
    ],
)
def test_bad_sim_settings_are_refused(settings, message):
    with pytest.raises(ValueError, match=message):
        EngineSettings(**settings)

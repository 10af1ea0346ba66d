"""The sampling noise: a pure function of (seed, position, token id), computed for a whole batch at once.

A generator's stream gives a token the draw of however many calls came before it; here each
token's exponential E is a counter-based hash of its key, so the same request draws the same
noise for the same token whatever else shares the batch, however its prompt was chunked, whether
its prefix came from the cache or it was preempted and recomputed. No per-row generator and no
per-row tensor work: each row's key is splitmix64 of (seed, position) on the host, sent with the
row's other settings; the noise is one pass of int32 tensor operations over [N, V] (Wellons'
lowbias32 of the row's key and the token's hash), on whatever device the logits are.

Torch has no unsigned 32-bit arithmetic everywhere we support, so the hash runs on signed int32:
* and ^ wrap modulo 2**32 (two's complement, as on every CPU and GPU torch runs on:
tests/test_sampling.py checks the results against plain Python integers), and >> is arithmetic,
so every right shift is masked to the bits a logical shift would keep.
"""

import functools

import torch


def _signed(value: int, bits: int) -> int:
    """The two's-complement signed integer with the same low `bits` bits as `value`."""
    value &= (1 << bits) - 1
    return value - (1 << bits) if value >> (bits - 1) else value


# splitmix64 (Steele, Lea and Flood; Vigna's constants), on the host's unbounded integers
_MASK64 = (1 << 64) - 1
_GOLDEN64 = 0x9E3779B97F4A7C15
_MIX64 = (0xBF58476D1CE4E5B9, 0x94D049BB133111EB)
# lowbias32 (Chris Wellons' hash-prospector), and the 32-bit golden ratio that spreads token ids
_GOLDEN32 = _signed(0x9E3779B9, 32)
_MIX32 = (_signed(0x7FEB352D, 32), _signed(0x846CA68B, 32))


def _shift_right(x: torch.Tensor, shift: int, bits: int) -> torch.Tensor:
    """Logical right shift of a signed integer tensor of `bits` bits."""
    return (x >> shift).bitwise_and_((1 << (bits - shift)) - 1)


def _splitmix64(x: int) -> int:
    x = (x + _GOLDEN64) & _MASK64
    x = ((x ^ (x >> 30)) * _MIX64[0]) & _MASK64
    x = ((x ^ (x >> 27)) * _MIX64[1]) & _MASK64
    return x ^ (x >> 31)


def row_key(seed: int, position: int) -> int:
    """The 32-bit key (as a signed int32) of (seed, position): the seed in [0, 2**63), the position of the
    token drawn. Nested, so seed s at position p + 1 is unrelated to seed s + 1 at p. A few integer
    operations per row on the host: on the device they would be as many kernel launches."""
    return _signed(_splitmix64(_splitmix64(seed) + position), 32)


def _lowbias32_(x: torch.Tensor, scratch: torch.Tensor | None = None) -> torch.Tensor:
    """lowbias32 of an int32 tensor, in place, but for its last xorshift: that one only mixes the high
    bits into the low ones, and the uniforms are taken from the high bits. `scratch`: a buffer of
    x's shape for the shifted copies (the [N, V] noise is the sampler's largest tensor: every
    allocation of it costs page faults on a CPU)."""
    for shift, multiplier in zip((16, 15), _MIX32):
        scratch = torch.bitwise_right_shift(x, shift, out=scratch)
        x ^= scratch.bitwise_and_((1 << (32 - shift)) - 1)  # a logical shift's bits
        x *= multiplier
    return x


@functools.lru_cache(maxsize=8)
def _token_hashes(vocab_size: int, device: torch.device) -> torch.Tensor:  # [V] int32, made once per device
    tokens = torch.arange(vocab_size, dtype=torch.int32, device=device)
    x = _lowbias32_(tokens * _GOLDEN32)
    return x ^ _shift_right(x, 16, 32)  # lowbias32 whole: these bits are mixed again with the row's key


def log_exponentials(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:  # [N] int32 -> [N, V] float32
    """log E for every row and token, E ~ Exp(1) a pure function of (row key, token id)."""
    bits = keys.unsqueeze(1) ^ _token_hashes(vocab_size, keys.device)  # [N, V] int32
    scratch = torch.empty_like(bits)  # [N, V] int32
    _lowbias32_(bits, scratch)
    # the top 23 bits as a signed integer i in [-2**22, 2**22); w = (i + 2**22 + 0.5) / 2**23 is uniform
    # in (0, 1), and -w = -i / 2**23 - (1/2 + 1/2**24) is exact in float32
    torch.bitwise_right_shift(bits, 9, out=scratch)
    minus_w = torch.mul(scratch, -(2.0**-23), out=bits.view(torch.float32)).sub_(0.5 + 2.0**-24)  # [N, V], over bits
    # E = -log(1 - w): log1p keeps E's relative precision where it is small, where the race is won
    return minus_w.log1p_().neg_().log_()  # [N, V] float32

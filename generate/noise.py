"""The sampling noise: a pure function of (seed, position, id), computed for a whole batch at once.

A generator's stream gives a token the draw of however many calls came before it; here each
token's exponential E = -log u is a counter-based hash of its key, so the same request draws the same
noise for the same token whatever else shares the batch, however its prompt was chunked, whether
its prefix came from the cache or it was preempted and recomputed. No per-row generator and no
per-row tensor work: each row's key is splitmix64 of (seed, position) on the host, sent with the
row's other settings; the noise is one pass of int32 tensor operations over the [N, K] ids a
step races (the last round and a half of Wellons' lowbias32 over the row's key xor the id's
lowbias32), on whatever device the logits are.

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
_MANTISSA_BITS = 23  # float32's
_ONE_AS_INT32 = 0x3F800000  # 1.0's float32 bits
# lowbias32 (Chris Wellons' hash-prospector), and the 32-bit golden ratio that spreads token ids
_GOLDEN32 = _signed(0x9E3779B9, 32)
_MIX32 = (_signed(0x7FEB352D, 32), _signed(0x846CA68B, 32))


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


def _xorshift_(x: torch.Tensor, shift: int) -> torch.Tensor:
    """x ^= x >>> shift on int32, in place."""
    x ^= (x >> shift).bitwise_and_((1 << (32 - shift)) - 1)  # a logical shift's bits
    return x


@functools.lru_cache(maxsize=8)
def id_hashes(count: int, device: torch.device) -> torch.Tensor:  # [count] int32, made once per device
    """lowbias32 of each id in [0, count) times the golden ratio: the half of a token's noise key that
    belongs to the token (the sampler also keys groups of tokens, by ids past the vocabulary)."""
    x = torch.arange(count, dtype=torch.int32, device=device) * _GOLDEN32
    for shift, multiplier in zip((16, 15), _MIX32):
        _xorshift_(x, shift).mul_(multiplier)
    return _xorshift_(x, 16)


def log_uniforms(keys: torch.Tensor, hashes: torch.Tensor) -> torch.Tensor:
    """log u for every row and id, u uniform on (0, 1) a pure function of (row key, id); -log u is the
    exponential E of the race. [N] int32 keys, [N, K] or [K] int32 id hashes (`id_hashes`) -> [N, K] float32."""
    # Both halves are mixed already (splitmix64, lowbias32): lowbias32's last round and a half mixes them
    # together (the first xorshift, which brings an input's high bits down, their mixing has done).
    bits = torch.bitwise_xor(keys.unsqueeze(1), hashes)  # [N, K]
    _xorshift_(bits.mul_(_MIX32[0]), 15).mul_(_MIX32[1])
    # The top 23 bits j as the mantissa of a float in [1, 2): f = 1 + j / 2**23, in integer operations
    # and a view. Then u = f - (1 - 2**-24) = (j + 1/2) / 2**23, exact, uniform on (0, 1), never 0 or 1.
    bits >>= 32 - _MANTISSA_BITS
    bits.bitwise_and_((1 << _MANTISSA_BITS) - 1).bitwise_or_(_ONE_AS_INT32)  # logical shift; 1.0's exponent
    u = bits.view(torch.float32).sub_(1 - 2.0 ** -(_MANTISSA_BITS + 1))  # [N, K]
    return u.log_()  # < 0; exact u keeps -log u's precision where it is small, where the race is won

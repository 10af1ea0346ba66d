"""Adapters on the device, side by side, and the LoRA delta of a step's rows, all rows at once.

Each (layer, target) has one A of `[in, S*R]` and one B of `[S*R, out]`: slot s holds its adapter's
A and B in columns / rows s*R .. s*R+r (zeros past its rank r, so a smaller rank adds nothing). A
step gives each row the slot of its sequence's adapter (-1: the base model). The delta is then two
dense products over every row, `((x @ A) * mask) @ B`, where the mask keeps each row's own slot's R
columns of x @ A and zeroes the others: the same result as gathering each row's A and B and
multiplying row by row (Punica's BGMV), as two ordinary matmuls that every backend runs well.
Its cost is 2*(in+out)*S*R flops a row, against the base's 2*in*out, so only slots up to the highest
one in use are computed; a step with no adapter row computes nothing (StepBatch.lora is None).
"""

from collections import OrderedDict
from typing import NamedTuple

import torch

from model.gpt2 import GPTConfig
from model.lora import Key, LoraAdapter, target_shapes


class LoraStep(NamedTuple):
    """One step's adapters: the slots' weights (sliced to the slots in use) and each row's mask."""

    a: dict[Key, torch.Tensor]  # [in, W] each, W = (highest slot in use + 1) * R
    b: dict[Key, torch.Tensor]  # [W, out]
    mask: torch.Tensor  # [T, W] 1 in the columns of a row's slot, else 0

    def add(self, y: torch.Tensor, x: torch.Tensor, key: Key) -> torch.Tensor:
        """y + the LoRA delta of x for the target `key`, every row through its own adapter."""
        a = self.a.get(key)
        if a is None:  # no adapter in a slot targets this module
            return y
        return torch.addmm(y, (x @ a) * self.mask, self.b[key])  # [T, out]


class LoraSlots:
    """MAX_LORAS device slots of rank MAX_LORA_RANK, filled from adapters as steps need them (least recently
    used out). Only the engine's thread uses this."""

    def __init__(self, config: GPTConfig, num_slots: int, max_rank: int, device: torch.device, dtype: torch.dtype):
        assert num_slots >= 1 and max_rank >= 1
        self.num_slots, self.rank, self.device, self.dtype = num_slots, max_rank, device, dtype
        self.shapes = target_shapes(config)
        self.a: dict[Key, torch.Tensor] = {}  # allocated for a target when an adapter first uses it
        self.b: dict[Key, torch.Tensor] = {}
        self._slot_of: OrderedDict[int, int] = OrderedDict()  # adapter id -> slot, least recently used first
        self.num_loads = 0  # adapters copied into a slot (for tests and /stats)

    def place(self, adapters: list[LoraAdapter]) -> dict[int, int]:
        """A slot for each adapter (at most num_slots distinct), copying in those not resident; id -> slot."""
        wanted = {a.id: a for a in adapters}
        assert len(wanted) <= self.num_slots, f"{len(wanted)} adapters in one step, {self.num_slots} slots"
        for adapter_id in wanted:
            if adapter_id in self._slot_of:
                self._slot_of.move_to_end(adapter_id)
        for adapter_id, adapter in wanted.items():
            if adapter_id not in self._slot_of:
                self._slot_of[adapter_id] = slot = self._free_slot(wanted)
                self._write(slot, adapter)
        return {adapter_id: self._slot_of[adapter_id] for adapter_id in wanted}

    def _free_slot(self, wanted: dict[int, LoraAdapter]) -> int:
        used = set(self._slot_of.values())
        free = [s for s in range(self.num_slots) if s not in used]
        if free:
            return free[0]  # the lowest: a step computes slots up to the highest in use
        victim = next(i for i in self._slot_of if i not in wanted)  # least recently used not needed now
        return self._slot_of.pop(victim)

    def _write(self, slot: int, adapter: LoraAdapter) -> None:
        self.num_loads += 1
        r0, width = slot * self.rank, self.rank
        for key in set(self.a) | set(adapter.weights):
            if key not in self.a:
                n_in, n_out = self.shapes[key[1]]
                zeros = lambda *shape: torch.zeros(shape, device=self.device, dtype=self.dtype)  # noqa: E731
                self.a[key], self.b[key] = zeros(n_in, self.num_slots * width), zeros(self.num_slots * width, n_out)
            a, b = self.a[key], self.b[key]  # [in, S*R], [S*R, out]
            a[:, r0 : r0 + width].zero_()
            b[r0 : r0 + width].zero_()
            if key in adapter.weights:
                a_in, b_out = adapter.weights[key]  # [in, r], [r, out]
                r = a_in.shape[1]
                a[:, r0 : r0 + r].copy_(a_in)
                b[r0 : r0 + r].copy_(b_out)

    def step(self, row_slots: list[int]) -> LoraStep:
        """The step's LoraStep for rows whose slots are `row_slots` (-1: the base model)."""
        top = max(row_slots) + 1  # slots computed: 0 .. the highest in use (known on the host: no sync)
        assert top >= 1, "a LoRA step has a row with an adapter"
        width = top * self.rank
        rows = torch.tensor(row_slots, device=self.device)  # [T]
        column_slot = torch.arange(width, device=self.device) // self.rank  # [W]
        mask = (rows.unsqueeze(1) == column_slot).to(self.dtype)  # [T, W]
        return LoraStep({k: a[:, :width] for k, a in self.a.items()}, {k: b[:width] for k, b in self.b.items()}, mask)

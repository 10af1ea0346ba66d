"""From one step's logits to its tokens: which logits row belongs to what, each row's settings, logprobs.

The model returns the rows each sequence asked for (Sequence.logits_positions): its prompt
positions whose log-probabilities it still needs, then, if it samples, its last position.
In the common step no sequence asks for prompt log-probabilities, the logits are exactly
the sampling rows, and the one transfer back to the host is the sampled tokens.
"""

import torch

from generate.grammar_mask import StepMasks
from generate.sampling_ops import SamplingRow, SamplingTensors, sample, top_logprobs
from generate.sequence import Sequence, TokenLogprobs
from model.tokenizer import EOT_ID


class Sampler:
    def __init__(self, device: torch.device):
        self.device = device

    def __call__(self, seqs: list[Sequence], logits: torch.Tensor, masks: StepMasks | None = None) -> list[int | None]:
        """The next token of each sequence that samples, None for the others; logprobs recorded on the way.
        `masks` (filled) rule out the tokens each constrained row's grammar forbids, before anything else."""
        prompt_rows, sample_rows = _layout(seqs)
        if prompt_rows:
            self._record_prompt_logprobs(seqs, logits, prompt_rows)
            logits = logits[torch.tensor(sample_rows, dtype=torch.long, device=self.device)]
        sampling = [s for s in seqs if s.samples_this_step]
        if not sampling:
            return [None] * len(seqs)
        settings = SamplingTensors.build([sampling_row(s) for s in sampling], logits.shape[1], self.device)
        sampled = sample(logits if masks is None else masks.apply(logits), settings)  # [N]
        self._record_logprobs(sampling, logits, sampled)  # the model's own distribution, unmasked
        tokens = iter(sampled.tolist())
        return [next(tokens) if s.samples_this_step else None for s in seqs]

    def on_device(self, seqs: list[Sequence], logits: torch.Tensor, positions: list[int] | None = None) -> torch.Tensor:
        """Each row's token, left on the device: rows that need nothing read back on the host (no
        log-probabilities, penalties or constraint: `needs_host_state` is False for every one).
        `positions`: where each row's token goes in its sequence (default: just past its token list)."""
        if positions is None:
            positions = [len(s.token_ids) for s in seqs]
        rows = [sampling_row(s, p) for s, p in zip(seqs, positions)]
        return sample(logits, SamplingTensors.build(rows, logits.shape[1], self.device))  # [N]

    @staticmethod
    def _record_logprobs(seqs: list[Sequence], logits: torch.Tensor, sampled: torch.Tensor) -> None:
        rows = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
        if not rows:
            return
        n = max(seqs[i].params.logprobs for i in rows)
        chosen, top_ids, top_values = top_logprobs(logits[rows], sampled[rows], n)
        for i, entry in zip(rows, _entries(chosen, top_ids, top_values)):
            seqs[i].logprobs.append(_keep(entry, seqs[i].params.logprobs))

    def _record_prompt_logprobs(self, seqs: list[Sequence], logits: torch.Tensor, rows: list[int]) -> None:
        wanting = [s for s in seqs if s.prompt_logprob_positions()]
        targets = [s.token_ids[p + 1] for s in wanting for p in s.prompt_logprob_positions()]
        n = max(s.params.prompt_logprobs for s in wanting)
        row_index = torch.tensor(rows, dtype=torch.long, device=self.device)
        chosen, top_ids, top_values = top_logprobs(logits[row_index], torch.tensor(targets, device=self.device), n)
        entries = iter(_entries(chosen, top_ids, top_values))
        for seq in wanting:
            k = seq.params.prompt_logprobs
            seq.prompt_logprobs += [_keep(next(entries), k) for _ in seq.prompt_logprob_positions()]


def needs_host_state(seq: Sequence) -> bool:
    """Whether sampling this sequence's next token reads what the host learns from its last one (penalties
    count the tokens so far, a constraint's mask follows them) or sends more than the token back."""
    p = seq.params
    return p.has_penalties or p.logprobs is not None or p.prompt_logprobs is not None or seq.matcher is not None


def _layout(seqs: list[Sequence]) -> tuple[list[int], list[int]]:
    """Logits rows holding prompt log-probability positions, and those of the sampling positions."""
    prompt_rows, sample_rows, row = [], [], 0
    for seq in seqs:
        count = len(seq.prompt_logprob_positions())
        prompt_rows += range(row, row + count)
        row += count
        if seq.samples_this_step:
            sample_rows.append(row)
            row += 1
    return prompt_rows, sample_rows


def sampling_row(seq: Sequence, position: int | None = None) -> SamplingRow:
    """A sequence's settings for the token it draws at `position` (default: just past its token list); the
    draw's noise is keyed by its seed and that position, and the tokens generated before it count toward
    min_tokens."""
    p = seq.params
    position = len(seq.token_ids) if position is None else position
    bias = p.logit_bias
    if p.stop_at_eos and position - seq.num_prompt_tokens < p.min_tokens:
        bias += ((EOT_ID, -float("inf")),)  # min_tokens: end-of-text cannot be drawn yet
    return SamplingRow(
        temperature=p.temperature,
        top_k=p.top_k,
        top_p=p.top_p,
        seed=seq.seed,
        position=position,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        repetition_penalty=p.repetition_penalty,
        logit_bias=bias,
        output_ids=seq.completion_ids if p.has_penalties else (),
        prompt_ids=seq.token_ids[: seq.num_prompt_tokens] if p.repetition_penalty != 1 else (),
    )


def _entries(chosen: torch.Tensor, top_ids: torch.Tensor, top_values: torch.Tensor) -> list[TokenLogprobs]:
    return [
        TokenLogprobs(logprob, tuple(zip(ids, values)))
        for logprob, ids, values in zip(chosen.tolist(), top_ids.tolist(), top_values.tolist())
    ]


def _keep(entry: TokenLogprobs, n: int) -> TokenLogprobs:
    return TokenLogprobs(entry.logprob, entry.top[:n])

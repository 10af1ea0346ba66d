"""Deterministic benchmark workload: prompts, requested lengths and arrival times."""

import math
import random
from typing import NamedTuple

_TASKS = (
    "Write a short story about {subject}",
    "Describe a day in the life of {subject}",
    "Write a poem about {subject}",
    "Explain to a curious child what it is like to be {subject}",
    "Write a news report about {subject}",
    "Write a letter from the point of view of {subject}",
    "Invent a folk tale about {subject}",
    "Write the opening scene of a play about {subject}",
)

_SUBJECTS = (
    "a lighthouse keeper",
    "an old clockmaker",
    "a young astronaut",
    "a retired detective",
    "a street musician",
    "a beekeeper",
    "a ship's cook",
    "a mountain guide",
    "a librarian",
    "a robot gardener",
    "a night-shift nurse",
    "a small-town baker",
    "a deep-sea diver",
    "a chess prodigy",
    "a forgotten king",
    "a travelling magician",
)

_CLAUSES = (
    "who finds a message in a bottle",
    "who cannot remember the past year",
    "who discovers a hidden door",
    "who has to cross a frozen lake",
    "who befriends a stray fox",
    "who receives a mysterious letter",
    "who loses everything in a storm",
    "who wins a contest by accident",
    "who hears music no one else can hear",
    "who must keep a difficult promise",
)

_DETAILS = (
    "The story takes place during a long winter storm.",
    "Use vivid but simple language that a teenager would enjoy.",
    "Include at least one surprising twist near the end.",
    "Keep the tone warm and a little bit funny.",
    "Mention the smell of the sea and the sound of distant bells.",
    "Write in the first person and in the present tense.",
    "The main character should change their mind about something important.",
    "End with a question that stays with the reader.",
    "Describe the setting in detail before any dialogue begins.",
    "Avoid clichés and try to make every sentence count.",
    "Set it in a city where it has not stopped raining for years.",
    "Add a minor character who speaks only in riddles.",
)

# Up to this many detail sentences are appended, which spreads prompts over roughly 5-60 words.
_MAX_DETAILS = 4


class Sample(NamedTuple):
    prompt: str
    num_tokens: int


class PromptData:
    """Prompts and requested token counts that depend only on the constructor arguments.

    `samples(n)` is a prefix of `samples(m)` for n < m, so runs of different sizes share their first requests.
    """

    def __init__(
        self,
        seed: int = 0,
        mean_tokens: float = 100,
        std_tokens: float = 50,
        min_tokens: int = 1,
        max_tokens: int = 200,
    ) -> None:
        if std_tokens < 0:
            raise ValueError(f"std_tokens must be >= 0, got {std_tokens}")
        if not 1 <= min_tokens <= max_tokens:
            raise ValueError(f"need 1 <= min_tokens <= max_tokens, got {min_tokens} and {max_tokens}")
        self.seed = seed
        self.mean_tokens = mean_tokens
        self.std_tokens = std_tokens
        self.min_tokens = min_tokens
        self.max_tokens = max_tokens

    def samples(self, n: int) -> list[Sample]:
        rng = random.Random(self.seed)
        return [Sample(self._prompt(rng), self._num_tokens(rng)) for _ in range(n)]

    def _prompt(self, rng: random.Random) -> str:
        subject = rng.choice(_SUBJECTS)
        if rng.random() < 0.5:
            subject = f"{subject} {rng.choice(_CLAUSES)}"
        details = rng.sample(_DETAILS, rng.randint(0, _MAX_DETAILS))
        return " ".join([rng.choice(_TASKS).format(subject=subject) + ".", *details])

    def _num_tokens(self, rng: random.Random) -> int:
        drawn = round(rng.gauss(self.mean_tokens, self.std_tokens))
        return min(max(drawn, self.min_tokens), self.max_tokens)


def arrival_offsets(n: int, rate: float, seed: int = 0) -> list[float]:
    """Send times in seconds from the start of a run, for `n` requests arriving as a Poisson process.

    The first request goes at 0 so a run starts at once; the gaps between requests are exponential with
    mean 1/rate. `rate=inf` sends everything at 0.
    """
    if not rate > 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    if math.isinf(rate):
        return [0.0] * n
    # A string seed gives a stream independent of PromptData's, which is seeded with the bare integer.
    rng = random.Random(f"arrivals:{seed}")
    offsets = []
    now = 0.0
    for _ in range(n):
        offsets.append(now)
        now += rng.expovariate(rate)
    return offsets

"""What prompt caching costs and saves on a paid API: the arithmetic behind notebook 12b.

A hosted API bills every prompt token in one of three ways:

    prompt     [0, read)           read from the provider's cache          read_multiplier  x input price
               [read, written)     computed and stored for later requests  write_multiplier x input price
               [written, len)      computed and forgotten                  1 x input price

Anthropic makes caching explicit (a `cache_control` breakpoint; the tokens up to it that the cache did not
hold are written at 1.25x for a 5-minute entry or 2x for a 1-hour one; a hit is read at 0.1x). OpenAI caches
every prompt of 1,024 tokens or more on its own, with no write premium, and reads the cached part at a
discount that depends on the model. Either way a prefix shorter than the model's minimum is never cached.

The table below is dated and sourced: prices change, so check the source before quoting a figure. The
multipliers are what the arithmetic needs; the dollar amounts only scale it.
"""
from __future__ import annotations

from dataclasses import dataclass

PRICES_AS_OF = "2026-11-27"  # the day the table was checked against the sources below; prices change
ANTHROPIC_SOURCE = "https://platform.claude.com/docs/en/build-with-claude/prompt-caching"
OPENAI_SOURCE = "https://developers.openai.com/api/docs/guides/prompt-caching"
OPENAI_PRICING = "https://openai.com/api/pricing/"


@dataclass(frozen=True)
class CachePrices:
    """How one model's API bills a prompt's tokens with prompt caching."""

    vendor: str
    model: str
    input_per_mtok: float  # dollars per million uncached input tokens
    write_multiplier: float  # a token written to the cache, x the input price (1.0: no premium)
    read_multiplier: float  # a token read from the cache, x the input price
    min_cacheable_tokens: int  # a shorter prefix is never cached (no write, no read)
    granularity: int = 1  # a cached prefix counts in steps of this many tokens (OpenAI: 128)
    retention: str = "5m"  # how long an unused entry lives ("5m", "1h", "in_memory", "24h")
    source: str = ""

    def __post_init__(self):
        if self.input_per_mtok < 0 or self.write_multiplier < 0 or not 0 <= self.read_multiplier <= 1:
            raise ValueError(f"{self.model}: prices must be >= 0 and a cache read at most the input price "
                             f"(read_multiplier {self.read_multiplier}); check the vendor's table")
        if self.min_cacheable_tokens < 0 or self.granularity < 1:
            raise ValueError(f"{self.model}: min_cacheable_tokens must be >= 0 and granularity >= 1, got "
                             f"{self.min_cacheable_tokens} and {self.granularity}")


def _anthropic(model: str, price: float, minimum: int, retention: str = "5m") -> CachePrices:
    write = {"5m": 1.25, "1h": 2.0}[retention]
    return CachePrices("Anthropic", model, price, write, 0.1, minimum, 1, retention, ANTHROPIC_SOURCE)


def _openai(model: str, price: float, read: float, retention: str = "in_memory") -> CachePrices:
    return CachePrices("OpenAI", model, price, 1.0, read, 1024, 128, retention, f"{OPENAI_SOURCE} ; {OPENAI_PRICING}")


# Checked on PRICES_AS_OF; the vendors change prices and minimums, so re-check the sources before use.
PRICES: dict[str, CachePrices] = {p.model if p.retention in ("5m", "in_memory") else f"{p.model} ({p.retention})": p
                                  for p in [
    _anthropic("claude-sonnet-4.5", 3.00, 1024),
    _anthropic("claude-sonnet-4.5", 3.00, 1024, "1h"),
    _anthropic("claude-haiku-3.5", 0.80, 2048),
    _anthropic("claude-opus-4.5", 5.00, 4096),
    _anthropic("claude-haiku-4.5", 1.00, 4096),
    _openai("gpt-5", 1.25, 0.1),
    _openai("gpt-5", 1.25, 0.1, "24h"),  # prompt_cache_retention="24h": extended retention, same prices
    _openai("gpt-4.1", 2.00, 0.25),
    _openai("gpt-4o", 2.50, 0.5),
]}


@dataclass(frozen=True)
class Bill:
    """The input tokens of one request, split the way the API bills them."""

    uncached: int
    written: int
    read: int

    @property
    def tokens(self) -> int:
        return self.uncached + self.written + self.read

    def cost(self, prices: CachePrices) -> float:
        """Dollars for this request's input tokens."""
        units = self.uncached + self.written * prices.write_multiplier + self.read * prices.read_multiplier
        return units * prices.input_per_mtok / 1e6


def request_bill(prompt_tokens: int, cached_prefix: int, prices: CachePrices, cache: bool = True) -> Bill:
    """Bill one prompt of `prompt_tokens`, of which the first `cached_prefix` are in the provider's cache.

    cache=False: the request asks for no caching (no breakpoint): every token is uncached. Otherwise the
    cached part is read (rounded down to the granularity, and only if it reaches the minimum), and the
    rest is written if the whole prompt reaches the minimum (with no write premium, as at OpenAI, a
    written token costs the input price)."""
    if prompt_tokens < 0 or not 0 <= cached_prefix <= prompt_tokens:
        raise ValueError(f"cached_prefix must be between 0 and prompt_tokens ({prompt_tokens}), got {cached_prefix}")
    if not cache or prompt_tokens < prices.min_cacheable_tokens:
        return Bill(prompt_tokens, 0, 0)
    read = cached_prefix // prices.granularity * prices.granularity
    if read < prices.min_cacheable_tokens:
        read = 0
    return Bill(0, prompt_tokens - read, read)


def replay_cost(prompt_tokens: list[int], cached_prefixes: list[int], prices: CachePrices,
                cache: bool = True) -> float:
    """Dollars for the input of a sequence of requests (what a replay on the engine measured)."""
    if len(prompt_tokens) != len(cached_prefixes):
        raise ValueError(f"{len(prompt_tokens)} prompts but {len(cached_prefixes)} cached prefixes; "
                         "give one per prompt")
    return sum(request_bill(n, c, prices, cache).cost(prices) for n, c in zip(prompt_tokens, cached_prefixes))


def hit_rate(prompt_tokens: list[int], cached_prefixes: list[int]) -> float:
    """Share of all prompt tokens served from the cache (what llm.stats()['prefix_cache']['hit_rate'] counts)."""
    total = sum(prompt_tokens)
    return sum(cached_prefixes) / total if total else 0.0


def growing_context(base: int, append: int, steps: int) -> list[int]:
    """Prompt lengths of an agent loop: a base prompt, then every step appends `append` tokens (the model's
    tool call and the tool's result) and sends the whole context again."""
    if base < 1 or append < 0 or steps < 1:
        raise ValueError(f"need base >= 1, append >= 0 and steps >= 1, got {base}, {append}, {steps}")
    return [base + k * append for k in range(steps)]


def agent_loop_hit_rate(base: int, append: int, steps: int) -> float:
    """Hit rate of that loop with an ideal cache (each step finds the whole previous prompt): 1 - what was new
    over all that was sent. It approaches 1 - append / context as the loop runs."""
    lengths = growing_context(base, append, steps)
    return hit_rate(lengths, [0] + lengths[:-1])


def uses_to_break_even(write_multiplier: float, read_multiplier: float) -> int:
    """The number of uses of a prefix (the write included) from which caching it costs less than sending it
    uncached every time: the smallest n with  w + (n - 1) r  <  n."""
    if not 0 <= read_multiplier < 1:
        raise ValueError(f"read_multiplier must be in [0, 1) for caching ever to pay, got {read_multiplier}")
    n = 1  # w + (n - 1) r < n  holds from  n - 1 > (w - 1) / (1 - r)  on; counted, so rounding cannot move it
    while cost_ratio(n, write_multiplier, read_multiplier) >= 1:
        n += 1
    return n


def cost_ratio(uses: int, write_multiplier: float, read_multiplier: float) -> float:
    """Cached cost / uncached cost of a prefix used `uses` times: (w + (n - 1) r) / n."""
    if uses < 1:
        raise ValueError(f"uses must be >= 1, got {uses}")
    return (write_multiplier + (uses - 1) * read_multiplier) / uses


def table() -> str:
    """The price table with each model's break-even, as text."""
    lines = [f"prompt-caching prices as of {PRICES_AS_OF} (they change: check the sources)",
             f"{'model':<28}{'$/MTok in':>10}{'write':>7}{'read':>6}{'min tokens':>11}{'break-even uses':>16}"]
    for name, p in PRICES.items():
        lines.append(f"{name:<28}{p.input_per_mtok:>10.2f}{p.write_multiplier:>6.2f}x{p.read_multiplier:>5.2f}x"
                     f"{p.min_cacheable_tokens:>11,}{uses_to_break_even(p.write_multiplier, p.read_multiplier):>16}")
    lines += ["sources: " + ANTHROPIC_SOURCE, "         " + OPENAI_SOURCE, "         " + OPENAI_PRICING]
    return "\n".join(lines)


if __name__ == "__main__":
    import argparse

    argparse.ArgumentParser(description="Prompt-caching prices (dated, sourced) and the uses at which a cache "
                                        "write pays; notebook 12b replays an agent loop over them.").parse_args()
    print(table())

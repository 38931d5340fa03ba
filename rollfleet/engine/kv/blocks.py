"""The KV pool's pages as the scheduler sees them (host side, pure Python; tp rank 0 only).

The device pool (kv/pool.py) is `num_pages` pages of `page_size` token slots each; page 0 is the
trash page that padded rows and padded tokens write to, never handed out. A sequence owns a list
of pages (its block table). Pages are reference-counted: the n samples of a prompt share its full
pages (`fork`), and so do requests whose prompts start alike (the prefix cache).

Prefix cache: a full page is named by a hash chained over every token up to its end, under a root
that names what else the KV depends on (kv/steps.py: the base weights' generation and the LoRA
adapter's load), so chains made under other weights never meet; `record_filled` records a running
sequence's page once the step that filled it is read back (its KV is written), `register` the full
pages of a sequence not recorded yet (a prompt after its prefill, the rest at its end), `match` finds
the longest run of recorded pages a new sequence starts with. A recorded page nobody holds stays
cached (LRU) until an allocation needs it back; `flush` forgets every record at once (pages of
records no root can match any more).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

TRASH_PAGE = 0


class OutOfPages(RuntimeError):
    """Fewer free pages than asked for: the caller preempts or waits; nothing was allocated."""


def page_hashes(
    tokens: list[int],
    page_size: int,
    root: str,
    limit: int | None = None,
    start: int = 0,
    previous: bytes | None = None,
) -> list[bytes]:
    """The chained hash of each full page of `tokens` (at most `limit` pages) from page `start` on,
    chained on `previous` (page `start - 1`'s hash; None: the root's), over the tokens as 64-bit
    integers (one conversion for all pages: 512 finished sequences of 320 tokens registered in 8 ms,
    as each page's repr 18)."""
    full = len(tokens) // page_size if limit is None else min(limit, len(tokens) // page_size)
    data, width = array("q", tokens[start * page_size : full * page_size]).tobytes(), 8 * page_size
    hashes = []
    if previous is None:
        previous = _root_hash(root)
    for offset in range(0, (full - start) * width, width):
        previous = _chained(previous, data[offset : offset + width])
        hashes.append(previous)
    return hashes


def _root_hash(root: str) -> bytes:
    """What the first page of a chain is chained on."""
    return hashlib.blake2b(root.encode(), digest_size=16).digest()


def _chained(previous: bytes, page: bytes) -> bytes:
    """A page's hash: its tokens (as 64-bit integers) chained on the page before's hash."""
    return hashlib.blake2b(previous + page, digest_size=16).digest()


class BlockPool:
    def __init__(self, num_pages: int, page_size: int, prefix_cache: bool = True):
        if num_pages < 2:
            raise ValueError(f"num_pages={num_pages}: the KV pool needs the trash page and at least one more")
        self.num_pages, self.page_size, self.prefix_cache = num_pages, page_size, prefix_cache
        self.free: list[int] = list(range(num_pages - 1, TRASH_PAGE, -1))  # popped from the end: 1, 2, ...
        self.refs = [0] * num_pages
        self.hash_of: dict[int, bytes] = {}  # recorded page -> its chained hash
        self.page_of: dict[bytes, int] = {}
        self.idle_cached: OrderedDict[int, None] = OrderedDict()  # recorded pages nobody holds, oldest first

    @property
    def available(self) -> int:
        """Pages an allocation can take now: free ones and cached ones nobody holds."""
        return len(self.free) + len(self.idle_cached)

    @property
    def usable(self) -> int:
        """Every page but the trash page."""
        return self.num_pages - 1

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def allocate(self, count: int) -> list[int]:
        """`count` pages, each held once; OutOfPages (and nothing taken) when fewer are available."""
        if count > self.available:
            raise OutOfPages(f"{count} pages asked, {self.available} available")
        pages = []
        for _ in range(count):
            if self.free:
                page = self.free.pop()
            else:  # the least recently used cached page nobody holds: its record goes
                page, _ = self.idle_cached.popitem(last=False)
                del self.page_of[self.hash_of.pop(page)]
            self.refs[page] = 1
            pages.append(page)
        return pages

    def hold(self, pages: list[int]) -> None:
        """One more holder of each page (a fork, a prefix hit)."""
        for page in pages:
            if self.refs[page] == 0:
                self.idle_cached.pop(page)
            self.refs[page] += 1

    def release(self, pages: list[int]) -> None:
        """One holder fewer of each page; a page nobody holds is free again, or idle in the cache."""
        for page in pages:
            assert self.refs[page] > 0, f"page {page} released more often than held"
            self.refs[page] -= 1
            if self.refs[page] == 0:
                if page in self.hash_of:
                    self.idle_cached[page] = None
                else:
                    self.free.append(page)

    def match(self, tokens: list[int], root: str) -> list[int]:
        """The recorded pages `tokens` starts with (held once more each, for the caller), leaving at
        least one token to compute (its logits give the next token)."""
        if not self.prefix_cache:
            return []
        pages = []
        for digest in page_hashes(tokens, self.page_size, root, limit=(len(tokens) - 1) // self.page_size):
            page = self.page_of.get(digest)
            if page is None:
                break
            pages.append(page)
        self.hold(pages)
        return pages

    def register(self, tokens: list[int], pages: list[int], root: str) -> None:
        """Record the full pages of a sequence whose KV of `tokens` is written in `pages`."""
        if not self.prefix_cache:
            return
        # its leading recorded pages (its prompt's, recorded at its prefill and shared by its n samples)
        # are not hashed again: a page it holds has its content's hash, and the chain goes on from it
        known = 0
        while known < len(pages) and pages[known] in self.hash_of:
            known += 1
        previous = self.hash_of[pages[known - 1]] if known else None
        for page, digest in zip(
            pages[known:], page_hashes(tokens, self.page_size, root, start=known, previous=previous)
        ):
            if digest in self.page_of or page in self.hash_of:
                continue  # the same content is recorded under another page already, or this page is
            self.hash_of[page], self.page_of[digest] = digest, page

    def record_filled(self, filled: list[tuple[list[int], int, list[int], str]]) -> None:
        """Record a page of each of `filled`: (a running sequence's pages, how many of them are full,
        the last full one's tokens, its root): a step just filled it. Chained on the page before it;
        one whose page before is not recorded (another page holds that content) is left to `register`
        at the sequence's end. A wave's decode steps fill its pages together, so its end hashes next
        to nothing (the retire of 512 samples of 256 tokens on an H100: 40.5 -> 8.9 ms)."""
        if not self.prefix_cache:
            return
        hash_of, page_of = self.hash_of, self.page_of
        for pages, full, window, root in filled:
            page = pages[full - 1]
            previous = hash_of.get(pages[full - 2]) if full > 1 else _root_hash(root)
            if previous is None or page in hash_of:
                continue
            digest = _chained(previous, array("q", window).tobytes())
            if digest not in page_of:  # else the same content is recorded under another page
                hash_of[page], page_of[digest] = digest, page

    def flush(self) -> None:
        """Forget every record; idle cached pages are free again."""
        self.free.extend(self.idle_cached)
        self.idle_cached.clear()
        self.hash_of.clear()
        self.page_of.clear()

    def reset(self) -> None:
        """Every page free (the device pool was released: no KV survives)."""
        self.__init__(self.num_pages, self.page_size, self.prefix_cache)

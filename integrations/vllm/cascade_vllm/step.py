"""One engine step as a cascade tree: the spans the step's sequences share, found from identical block ids.

Independent of vLLM (plain lists in, plain lists out) so that it is tested without an engine.
"""

from dataclasses import dataclass


@dataclass
class StepTree:
    """A step's sequences as cascade segments over a paged cache.

    segments[g]: segment g's length in tokens; starts[g]: its first token in the cache's token view (see
    token_start); paths[s]: sequence s's segment ids from the root; n_query[s]: its query tokens (the last ones
    of its keys); n_shared: segments read by more than one sequence.
    """
    segments: list[int]
    starts: list[int]
    paths: list[list[int]]
    n_query: list[int]
    n_shared: int


def token_start(block: int, offset: int, block_size: int) -> int:
    """The token index of (block, offset) in the views backend.cache_view() makes of a cache whose blocks hold
    block_size key rows then block_size value rows: token tau = block * 2 * block_size + offset."""
    return block * 2 * block_size + offset


def build_step_tree(seq_lens: list[int], query_lens: list[int], block_rows: list[list[int]],
                    block_size: int) -> StepTree:
    """Builds the tree of one step.

    seq_lens[s]: sequence s's keys (its cached tokens plus this step's queries); query_lens[s] its query
    tokens (a sequence with none is left out: it owns no query rows); block_rows[s]: its block table row (at least ceil(seq_lens[s] / block_size) ids). A block holds
    tokens [j * block_size, (j + 1) * block_size) of its sequence; two sequences share a segment where they hold
    the same block id with the same fill after the same chain of block ids (vLLM's prefix caching hands a full
    block to every request with that prefix), so the tree is a trie over block-id chains.
    """
    segments: list[int] = []
    starts: list[int] = []
    users: list[int] = []
    node_of: dict[tuple[int, int, int], int] = {}
    paths: list[list[int]] = []
    n_query: list[int] = []
    for seq_len, n_q, row in zip(seq_lens, query_lens, block_rows):
        if n_q == 0:
            continue
        n_blocks = -(-seq_len // block_size)
        if len(row) < n_blocks:
            raise ValueError(f"block table row holds {len(row)} blocks, sequence needs {n_blocks}")
        path: list[int] = []
        parent = -1
        for j in range(n_blocks):
            fill = min(block_size, seq_len - j * block_size)
            key = (parent, int(row[j]), fill)
            g = node_of.get(key)
            if g is None:
                g = len(segments)
                node_of[key] = g
                segments.append(fill)
                starts.append(token_start(int(row[j]), 0, block_size))
                users.append(0)
            users[g] += 1
            path.append(g)
            parent = g
        paths.append(path)
        n_query.append(n_q)
    n_shared = sum(1 for u in users if u > 1)
    return StepTree(segments, starts, paths, n_query, n_shared)

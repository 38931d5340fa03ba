"""What a set of episodes did with their time: turns, tokens, how they ended, and what tools cost.

Two measures of the tools' cost, both from the spans each episode records (`episode["lifetime"]`,
`["generate_spans"]`, `["tool_spans"]`: perf_counter seconds, [start, end]):
- `tool_wait_share`: the episodes' tool seconds over their tool + generate seconds, summed over
  episodes (how each episode spent its own time; overlapping waits all count).
- Against the rollout's wall clock (the time at least one of the episodes was in flight, `rollout_wall_seconds`):
  `tool_wall_share`, the share of it during which at least one episode waited on a tool, and
  `tool_only_wall_share`, the share during which tools ran and no generate call was in flight: the
  wall time the tools added, which overlapping them with other episodes' turns did not hide.
"""

from __future__ import annotations

from rollfleet.sample import Sample


def union_seconds(spans: list[list[float]]) -> float:
    """The length of the union of [start, end] spans (overlaps counted once)."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total


def wall_figures(samples: list[Sample]) -> dict:
    """The rollout's wall seconds and the shares of it that tools took (module docstring)."""
    lifetimes = [s.episode["lifetime"] for s in samples if s.episode.get("lifetime")]
    tools = [span for s in samples for span in s.episode.get("tool_spans", [])]
    generates = [span for s in samples for span in s.episode.get("generate_spans", [])]
    wall = union_seconds(lifetimes)
    tool_any = union_seconds(tools)
    tool_only = union_seconds(tools + generates) - union_seconds(generates)
    return {
        "rollout_wall_seconds": wall,
        "tool_wall_share": tool_any / wall if wall else 0.0,
        "tool_only_wall_share": max(tool_only, 0.0) / wall if wall else 0.0,
    }


def episode_figures(samples: list[Sample]) -> dict:
    """A step's episodes: turns, tokens, how they ended, and the share of their time spent in tools."""
    tool = sum(end - start for s in samples for start, end in s.episode.get("tool_spans", []))
    busy = tool + sum(end - start for s in samples for start, end in s.episode.get("generate_spans", []))
    reasons: dict[str, int] = {}
    for s in samples:
        reasons[s.finish_reason.get("type", "?")] = reasons.get(s.finish_reason.get("type", "?"), 0) + 1
    policy = sum(sum(s.loss_mask or []) for s in samples)
    return {
        "turns_mean": sum(s.turns for s in samples) / max(len(samples), 1),
        "trajectory_tokens_mean": sum(len(s.output_ids) for s in samples) / max(len(samples), 1),
        "policy_token_share": policy / max(sum(len(s.output_ids) for s in samples), 1),
        "tool_wait_share": tool / busy if busy else 0.0,
        **wall_figures(samples),
        "episode_finish": reasons,
    }

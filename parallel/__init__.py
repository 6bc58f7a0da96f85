"""Parallel layout, pipeline schedules, expert-parallel communication, placement and the planner."""

"""The training loop, optimizer and schedules, written against the facade only. Filled by the
single-device training issue."""

"""From evidence to answers: a report read back and checked, verdicts, gate, merge, the profile."""

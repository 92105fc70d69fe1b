"""Numbers and their bounds: accuracy, budgets, judgement, speed, one cell, long calls, spans, contexts."""

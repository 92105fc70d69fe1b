"""Qualification: measuring variants on fixtures and turning the evidence into verdicts.

`measure` (accuracy, memory, timing), `certify`, `worker` (an isolated measurement process),
`pool` (the parent's side of the workers), `fault_hooks` (the workers' test hooks),
`report` (report.json/md/html), `families` (model families and their verdicts), `speed`
(break-even), `profile` (the per-GPU profile the wrapper loads) and `gate` (the CI decision and the
fleet table). Builds on `serving` and `fixtures`; the CLI sits on top.
"""

"""Qualification: measuring variants and integrations on fixtures and turning the evidence into verdicts.

Stages whose imports run one way (`tests_fast/contracts/test_architecture.py` checks it):
`families` and `selection` (what a run takes), `evidence/` (what a run stores, typed), `measure/`
(numbers and their bounds), `integrations/` (other apps' code under test), `decide/` (verdicts,
gate, merge, the profile), `render/` (report.md/html, summary, JUnit), `selftest/` (the suite's
checks of itself) and `run/` (certify: plan once, execute in workers or in this process). Builds
on `serving` and `fixtures`; the CLI sits on top.
"""

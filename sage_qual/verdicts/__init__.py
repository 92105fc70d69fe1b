"""Torch-free records that the served path and the qualification side both apply: the fitness
table (`fitness`), read the same way by certify, gate, merge, the profile, the defaults' builder,
the first-call check and the audit. Imports nothing of sage_qual but the base modules."""

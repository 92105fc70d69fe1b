"""What can run and the model of what it computes: the kernel providers and their packages
(`providers`, `sage_package`, `kernel_imports`), every kernel variant with its declarations
(`variants`), the execution contexts (`contexts`) and the numerics model (`numerics`). Below the
torch-free records (`verdicts`) and the wrapper (`serving`); imports nothing of sage_qual but the
base modules."""

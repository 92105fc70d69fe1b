"""Serving: the production wrapper around SageAttention.

SDPA rebinding and dispatch (`wrapper`), the fallback rules (`eligibility`), the per-thread scope
(`scope`), thresholds and the kernel table (`config`), the kernel variants (`variants`), the
installed package's checks (`sage_package`), torch.cuda behind one seam (`platform`), kernel error
classes (`failures`) and the machine record of `sage-qual env` (`environment`). Nothing here
imports the fixture or qualification layers.
"""

"""Serving: the production wrapper around SageAttention.

SDPA rebinding and dispatch (`wrapper`), the fallback rules (`eligibility`), the per-thread scope
(`scope`), thresholds and the kernel table (`config`), the kernel variants and their kernels'
contracts (`variants`), what each GPU can run (`assess`), the installed package's checks
(`sage_package`), torch's own SDPA and binding over it (`torch_sdpa`), torch.cuda behind one seam
(`platform`), kernel error classes (`failures`), reading a certified profile (`profile`), the
built-in defaults measured here (`defaults`) and the machine record of `sage-qual env`
(`environment`; the record itself, torch-free, in `env_record`). Nothing here imports the fixture or
qualification layers.
"""

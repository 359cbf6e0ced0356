"""deltaspec.spec: MTP drafting, verification and acceptance (built on deltaspec.kernels)."""

"""Training stacks under accumcheck: one module per stack."""

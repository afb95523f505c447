"""Framework adapters (HuggingFace, Lightning); they call only fused_ce's public API."""

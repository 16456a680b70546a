"""The expert-signature formats shared by every stage (wire, dataset, transform)."""

"""The fit stage: signature transform fitting, balanced spherical k-means, artifacts."""

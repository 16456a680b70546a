"""The decode-routing brain: the policy, the artifact it reads, its online refits."""

"""What data/, model/ and training/ all use: the bad-input error type and its checks."""

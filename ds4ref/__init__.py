"""ds4ref: an exact reference for serving DeepSeek V4 Flash."""

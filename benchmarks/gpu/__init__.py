"""The GPU suite (gpu_suite.sh, one call on a lent GPU machine), what it needs beside the tree (gpu_bundle.sh), and the model it runs on."""

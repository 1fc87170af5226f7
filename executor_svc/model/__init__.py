"""The model side: the ragged-batch decoders (dense, MoE, hybrid DeltaNet), attention, and the torch
and C++ ops they run on."""

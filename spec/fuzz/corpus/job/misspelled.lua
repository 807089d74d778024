return { data = "d", learning_rate = 1e-3, [1] = 2 }

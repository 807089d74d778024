return { data = 5, n_layer = 1.5 }

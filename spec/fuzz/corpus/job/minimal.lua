return { data = "data/fortunes.txt" }

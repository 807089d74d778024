local t = {}
for w in ("a b c"):gmatch("%a") do t[#t + 1] = w:upper() end
return { data = table.concat(t, "/"), name = string.format("%q", "n\n"), seed = math.maxinteger }

while true do pcall(function() while truesetlo do end end) end
